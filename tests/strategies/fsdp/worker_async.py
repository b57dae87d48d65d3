"""`save.async` under FSDP with sharded checkpoints (DCP's async_save), one 2-process world.
Usage: torchrun --nproc_per_node=2 worker_async.py OUT

- `sync`: full_shard, sharded checkpoints every 3 steps to step 9, saved synchronously.
- `async`: the same with save.async. The write of checkpoint-6 is held inside DCP (on rank 0, the
  coordinator, after both ranks' shards are written and before `.metadata`) by an event, not a delay:
  rank 0's loop waits at the end of step 7 until DCP's thread is held there, counts the steps its loop
  takes while the write is held (7 and 8), copies the output folder as it
  stands (what a SIGKILL at that moment leaves on disk) to OUT/killed, then lets the write go.
- `resumed`: resume_from_checkpoint=true from OUT/killed, with save.async, to step 9.

Rank 0 writes OUT/result.pt: each run's final weights, the steps taken while the write was held,
whether checkpoint-6 was visible then, the files of OUT/killed as copied, the step `resumed` resumed
from, and the threads that ran DCP's writes."""

import os
import shutil
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint import filesystem  # noqa: E402

from kiln import Callback  # noqa: E402
from tests.strategies.fsdp import cases  # noqa: E402

out = sys.argv[1]
rank = int(os.environ["RANK"])
SAVE = {"strategy": "steps", "steps": 3}
EXTRA = {"max_steps": 9, "strategy": {**cases.FSDP, "state_dict_type": "sharded"}}
held, release = threading.Event(), threading.Event()
writers: list[str] = []
finish, write_data = filesystem._FileSystemWriter.finish, filesystem._FileSystemWriter.write_data


def held_finish(self, *args, **kwargs):  # runs on the coordinator (rank 0), on DCP's thread
    if self.path.parent.name == ".checkpoint-6.tmp" and not release.is_set():
        held.set()
        assert release.wait(120), "the step loop never released checkpoint-6's write"
    return finish(self, *args, **kwargs)


def recorded_write(self, *args, **kwargs):
    writers.append(threading.current_thread().name)
    return write_data(self, *args, **kwargs)


class WhileHeld(Callback):
    """Steps the loop takes while checkpoint-6's write is held; at the second, the snapshot and release."""

    reads_checkpoint_on_save = False

    def __init__(self, run: str) -> None:
        self.run, self.steps, self.visible, self.snapshot = run, [], [], []

    def on_step_end(self, config, state, control, **kw):
        if state.global_step == 7:  # the loop waits here until DCP's thread holds checkpoint-6's write: it
            assert held.wait(120)  # can only get there while the loop runs on (not waiting for the save)
        if held.is_set() and not release.is_set():
            self.steps.append(state.global_step)
            self.visible.append(os.path.exists(os.path.join(self.run, "checkpoint-6")))
            if len(self.steps) == 2:
                killed = os.path.join(out, "killed", "full_shard")
                shutil.copytree(self.run, killed)
                self.snapshot = sorted(
                    os.path.relpath(os.path.join(root, f), killed) for root, _, files in os.walk(killed) for f in files
                )
                release.set()


class ResumedAt(Callback):
    def on_train_begin(self, config, state, control, **kw):
        self.step = state.global_step


result: dict = {}
sync = cases.trainer_for("full_shard", os.path.join(out, "sync"), 2, save=SAVE, **EXTRA)
sync.fit()
result["sync"] = cases.full_weights(sync)

filesystem._FileSystemWriter.finish = held_finish  # from here on: the synchronous run is the reference
filesystem._FileSystemWriter.write_data = recorded_write
run = os.path.join(out, "async")
asynchronous = cases.trainer_for("full_shard", run, 2, save={**SAVE, "async": True}, **EXTRA)
watch = WhileHeld(os.path.join(run, "full_shard"))
if rank == 0:
    asynchronous.add_callback(watch)
else:
    release.set()  # only the coordinator's finish holds the write
asynchronous.fit()
result["async"] = cases.full_weights(asynchronous)
dist.barrier()

resumed = cases.trainer_for(
    "full_shard", os.path.join(out, "killed"), 2, save={**SAVE, "async": True}, resume_from_checkpoint="true", **EXTRA
)
at = ResumedAt()
resumed.add_callback(at)
resumed.fit()
result["resumed"] = cases.full_weights(resumed)
if rank == 0:
    result.update(steps_while_held=watch.steps, visible_while_held=watch.visible, resumed_at=at.step)
    result["killed_files"] = watch.snapshot  # the resumed run clears the half-written folder: listed before
    result["writers"] = sorted(set(writers))
    torch.save(result, os.path.join(out, "result.pt"))
dist.barrier()
dist.destroy_process_group()
