"""`save.async` under FSDP with full-state checkpoints (format `fsdp-full`), one 2-process world.
Usage: torchrun --nproc_per_node=2 worker_async_full.py OUT

- `sync`: full_shard, `state_dict_type: full`, checkpoints every 3 steps to step 9, saved synchronously.
- `async`: the same with save.async: the gathers run at the step boundary, the files are written on
  the background writer. Each rank records the threads that wrote the weights files, and rank 0 holds
  the write of checkpoint-6 (an event, not a delay) until its loop has taken step 7 and 8.

Rank 0 writes OUT/result.pt: each run's final weights, the writer threads, the steps the loop took while
checkpoint-6's write was held, and whether checkpoint-6 was visible then."""

import os
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kiln import Callback  # noqa: E402
from kiln.strategies.mesh import checkpoint_io  # noqa: E402
from tests.strategies.fsdp import cases  # noqa: E402

out = sys.argv[1]
rank = int(os.environ["RANK"])
SAVE = {"strategy": "steps", "steps": 3}
EXTRA = {"max_steps": 9, "strategy": {**cases.FSDP, "state_dict_type": "full"}}
held, release = threading.Event(), threading.Event()
writers: list[str] = []
save_weights = checkpoint_io.save_weights


def recorded(weights, directory, *args, **kwargs):  # type: ignore[no-untyped-def]
    writers.append(threading.current_thread().name)
    if os.path.basename(directory) == ".checkpoint-6.tmp" and rank == 0 and not release.is_set():
        held.set()
        assert release.wait(120), "the step loop never released checkpoint-6's write"
    return save_weights(weights, directory, *args, **kwargs)


class WhileHeld(Callback):
    reads_checkpoint_on_save = False

    def __init__(self, run: str) -> None:
        self.run, self.steps, self.visible = run, [], []

    def on_step_end(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step == 7:
            assert held.wait(120)
        if held.is_set() and not release.is_set():
            self.steps.append(state.global_step)
            self.visible.append(os.path.exists(os.path.join(self.run, "checkpoint-6")))
            if len(self.steps) == 2:
                release.set()


result: dict = {}
sync = cases.trainer_for("full_shard", os.path.join(out, "sync"), 2, save=SAVE, **EXTRA)
sync.fit()
result["sync"] = cases.full_weights(sync)

checkpoint_io.save_weights = recorded
run = os.path.join(out, "async")
asynchronous = cases.trainer_for("full_shard", run, 2, save={**SAVE, "async": True}, **EXTRA)
watch = WhileHeld(os.path.join(run, "full_shard"))
if rank == 0:
    asynchronous.add_callback(watch)
asynchronous.fit()
result["async"] = cases.full_weights(asynchronous)
if rank == 0:
    result.update(steps_while_held=watch.steps, visible_while_held=watch.visible, writers=sorted(set(writers)))
    torch.save(result, os.path.join(out, "result.pt"))
dist.barrier()
dist.destroy_process_group()
