"""The 2-node leg of tests/checkpoint/test_remote_nodes.py's asynchronous-upload world: each rank of a gloo
world is node RANK's only process, with a staging folder of its own (ROOT/node<RANK>), saving every 2
steps in the background (save.async_save, save.on_each_node) to URL. At step 3 every rank waits until its
background write of checkpoint-2 has finished; at step 4, before that step's save, rank 0 writes the
checkpoints the store then holds in ROOT/seen_at_4.json. Usage: remote_nodes_async_worker.py ROOT URL ENDPOINT"""

import json
import os
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from tests.checkpoint.store_world import one_process_per_node, store_options  # noqa: E402

RANK = one_process_per_node()

import torch.distributed as dist  # noqa: E402

from kiln.engine.callbacks.base import Callback  # noqa: E402
from kiln.engine.checkpoint.remote import RemoteCheckpoints  # noqa: E402
from tests.checkpoint.checkpoint_helpers import train  # noqa: E402

root, url, endpoint = sys.argv[1:4]
options = store_options(endpoint)


class Watch(Callback):
    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step == 3:  # the background write of checkpoint-2 finishes on this rank
            for thread in threading.enumerate():
                if thread.name == "kiln-checkpoint-2":
                    thread.join()
        if state.global_step == 4 and RANK == 0:
            with open(os.path.join(root, "seen_at_4.json"), "w") as fh:
                json.dump([name for _, name in RemoteCheckpoints(url, options).steps()], fh)


save = {
    "on_each_node": True,
    "async_save": True,
    "storage_options": options,
    "staging_dir": os.path.join(root, f"node{RANK}"),
}
train(url, {"max_steps": 6, "save_steps": 2, "save": save}, callbacks=[Watch()])
dist.destroy_process_group()
