"""The 2-node leg of tests/checkpoint/test_remote_nodes.py's asynchronous-upload world: each rank of a gloo
world is node RANK's only process, with a staging folder of its own (ROOT/node<RANK>), saving every 2
steps in the background (save.async_save, save.on_each_node) to URL. At step 3 every rank waits until its
background write of checkpoint-2 has finished; at step 4, before that step's save, rank 0 writes the
checkpoints the store then holds in ROOT/seen_at_4.json. The write of checkpoint-6, the last step's, takes a
second longer, so that the end of fit, not a step boundary, uploads it. Then URL-sigterm: rank 1 gets SIGTERM
at step 3 (save.on_preemption), and the run saves step 3 and stops. Each rank writes, in
ROOT/uploads_<RANK>.json, every checkpoint the nodes uploaded and the fit loop's function that did it, and
the step each preempted run stopped at in ROOT/preempted_<RANK>.json. Usage: remote_nodes_async_worker.py
ROOT URL ENDPOINT"""

import inspect
import json
import os
import signal
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from tests.checkpoint.store_world import one_process_per_node, store_options  # noqa: E402

RANK = one_process_per_node()

import torch.distributed as dist  # noqa: E402

from kiln.engine.callbacks.base import Callback  # noqa: E402
from kiln.engine.checkpoint.manager import CheckpointManager  # noqa: E402
from kiln.engine.checkpoint.remote import RemoteCheckpoints  # noqa: E402
from kiln.engine.checkpoint.remote_run import RunUploads  # noqa: E402
from tests.checkpoint.checkpoint_helpers import train  # noqa: E402

root, url, endpoint = sys.argv[1:4]
options = store_options(endpoint)
LOOP = ("step_end", "_finish", "_save_and_stop", "save")  # who calls CheckpointManager.wait
uploads: list[tuple[str, str]] = []
upload_from_nodes, complete = RunUploads.upload_from_nodes, CheckpointManager._complete


def logged(self, final, best, writer):  # type: ignore[no-untyped-def]
    caller = next(frame.function for frame in inspect.stack() if frame.function in LOOP)
    uploads.append((os.path.basename(final), caller))
    return upload_from_nodes(self, final, best, writer)


def last_one_slower(self, staged, tmp, final, *rest):  # type: ignore[no-untyped-def]
    if final.endswith("checkpoint-6"):
        time.sleep(1.0)
    return complete(self, staged, tmp, final, *rest)


RunUploads.upload_from_nodes = logged  # type: ignore[method-assign]
CheckpointManager._complete = last_one_slower  # type: ignore[method-assign]


class Watch(Callback):
    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step == 3:  # the background write of checkpoint-2 finishes on this rank
            for thread in threading.enumerate():
                if thread.name == "kiln-checkpoint-2":
                    thread.join()
        if state.global_step == 4 and RANK == 0:
            with open(os.path.join(root, "seen_at_4.json"), "w") as fh:
                json.dump([name for _, name in RemoteCheckpoints(url, options).steps()], fh)


class SigtermAt3(Callback):
    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step == 3 and RANK == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def save(staging: str, **more: object) -> dict:  # type: ignore[type-arg]
    where = os.path.join(root, staging, f"node{RANK}")
    return {"on_each_node": True, "async_save": True, "storage_options": options, "staging_dir": where, **more}


train(url, {"max_steps": 6, "save_steps": 2, "save": save("")}, callbacks=[Watch()])
stopped = train(
    f"{url}-sigterm",
    {"max_steps": 6, "save_steps": 4, "save": save("sigterm", on_preemption=True)},
    callbacks=[SigtermAt3()],
)
with open(os.path.join(root, f"uploads_{RANK}.json"), "w") as fh:
    json.dump(uploads, fh)
with open(os.path.join(root, f"preempted_{RANK}.json"), "w") as fh:
    json.dump(stopped.checkpoints.preempted_step, fh)
dist.destroy_process_group()
