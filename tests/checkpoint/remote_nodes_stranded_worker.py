"""The 2-node leg of tests/checkpoint/test_remote_nodes.py's stranded-checkpoint world: each rank of a gloo
world is node RANK's only process with a staging folder of its own (ROOT/node<RANK>), and FSDP (sharded
DCP) saves every 2 steps in the background (save.async_save, save.on_each_node) to URL.
Usage: remote_nodes_stranded_worker.py ROOT URL ENDPOINT MODE

- kill: once every rank's background write of checkpoint-4 has finished (its part sealed in each node's
  staging folder), and before the step boundary that uploads it, rank 0 writes the checkpoints the store
  holds in ROOT/store_at_kill.json and every rank is killed (SIGKILL).
- resume: the same run, resume_from_checkpoint=true, on the same two nodes, to step 6; each rank writes the
  checkpoints it loaded in ROOT/loaded_<RANK>.json. Then ROOT/straight: the same training, uninterrupted,
  in one local output_dir."""

import json
import os
import signal
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from tests.checkpoint.store_world import one_process_per_node, store_options  # noqa: E402

RANK = one_process_per_node()

import torch.distributed as dist  # noqa: E402

from kiln.engine.callbacks.base import Callback  # noqa: E402
from kiln.engine.checkpoint.manager import CheckpointManager  # noqa: E402
from kiln.engine.checkpoint.remote import RemoteCheckpoints  # noqa: E402
from tests.checkpoint.checkpoint_helpers import train  # noqa: E402
from tests.checkpoint.test_cross_format_resume import CHAIN, STRATEGIES  # noqa: E402

root, url, endpoint, mode = sys.argv[1:5]
options = store_options(endpoint)
cfg = {**CHAIN["cfg"], "strategy": STRATEGIES["fsdp-sharded"], "per_device_train_batch_size": 2}
save = {"on_each_node": True, "async_save": True, "storage_options": options, "staging_dir": f"{root}/node{RANK}"}


class KilledOnceWritten(Callback):
    """Right after step 4's save started (on_save comes before the step boundary's upload, step_end)."""

    def on_save(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step != 4:
            return
        for thread in threading.enumerate():
            if thread.name == "kiln-checkpoint-4":
                thread.join()
        dist.barrier()  # every node's part is sealed
        if RANK == 0:
            with open(os.path.join(root, "store_at_kill.json"), "w") as fh:
                json.dump([name for _, name in RemoteCheckpoints(url, options).steps()], fh)
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)


if mode == "kill":
    train(url, {**cfg, "save": save}, model_kw=CHAIN["model_kw"], callbacks=[KilledOnceWritten()])
    raise AssertionError("never reached: killed at step 4")
loaded: list[str] = []
load = CheckpointManager.load
CheckpointManager.load = lambda self, path: (loaded.append(os.path.basename(path)), load(self, path))[1]  # type: ignore[method-assign]
train(url, {**cfg, "save": save}, model_kw=CHAIN["model_kw"], resume=True)
with open(os.path.join(root, f"loaded_{RANK}.json"), "w") as fh:
    json.dump(loaded, fh)
train(os.path.join(root, "straight"), cfg, model_kw=CHAIN["model_kw"])
dist.destroy_process_group()
