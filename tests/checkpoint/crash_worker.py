"""A training process for the fault-injection test, driven over stdin/stdout.

Start it once (it imports torch and kiln, which takes seconds), then send `run OUT RESULT` lines: each
forks a fresh child that trains with `resume_from_checkpoint="if_exists"` into OUT and, if it finishes, writes
its final weights and numeric log history to RESULT. The worker answers `pid <pid>` at once and
`exit <status>` when the child ends; the test kills children with SIGKILL at random moments.

The child slows training down a little (a sleep after every step, one between the weights and the
optimizer file, and one before the marker), so that a run lasts long enough to be killed many times
and kills land inside a write often. When training begins it appends `<pid> <checkpoint it loaded>`
to `resumes.log` and creates `began-<pid>`, so the test can check the choice and time kills from
there. These hooks live only here; none changes the numerics."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from kiln.engine.callbacks.base import Callback
from kiln.engine.checkpoint import atomic
from kiln.engine.checkpoint import manager as checkpoint
from kiln.strategies.full_checkpoint_io import FullStateCheckpointIO
from tests.checkpoint.checkpoint_helpers import config, make_model, numeric_history, regression_data

WRITE_DELAY = 0.004
STEP_DELAY = 0.01
CONFIG = {
    "max_steps": 64,
    "save_steps": 4,
    "logging_steps": 4,
    "save_total_limit": 2,
    "learning_rate": 0.02,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 2,
}


def _slow_writes() -> None:
    save, fsync_tree = FullStateCheckpointIO.save, atomic._fsync_tree

    def slow_save(self, directory, *args, **kwargs):  # type: ignore[no-untyped-def]
        save(self, directory, *args, **kwargs)
        time.sleep(WRITE_DELAY)

    def slow_fsync(directory):  # type: ignore[no-untyped-def]
        sizes = fsync_tree(directory)
        time.sleep(WRITE_DELAY)
        return sizes

    FullStateCheckpointIO.save, atomic._fsync_tree = slow_save, slow_fsync


class Pace(Callback):
    """Marks the start of training (and records which checkpoint the Trainer really loaded), then
    sleeps a little after every step."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.loaded = "fresh"

    def on_train_begin(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        with open(os.path.join(self.run_dir, "resumes.log"), "a") as fh:
            fh.write(f"{os.getpid()} {self.loaded}\n")
        open(os.path.join(self.run_dir, f"began-{os.getpid()}"), "w").close()

    def on_step_end(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        time.sleep(STEP_DELAY)


def quiet() -> None:
    """A child's output goes nowhere (the worker's stdout is the test's channel); one thread."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    torch.set_num_threads(1)


def child(out: str, result: str) -> None:
    quiet()
    _slow_writes()
    train_and_record(out, result, CONFIG)


def train_and_record(out: str, result: str, settings: dict[str, Any]) -> None:
    """Train into `out` with `resume_from_checkpoint="if_exists"`, pacing and recording the resume
    (Pace); when done, write the final weights and numeric log history to `result`."""
    from kiln.engine.trainer import Trainer

    pace = Pace(os.path.dirname(out))
    load = checkpoint.CheckpointManager.load

    def recording_load(self, path):  # type: ignore[no-untyped-def]
        pace.loaded = os.path.basename(path)
        return load(self, path)

    checkpoint.CheckpointManager.load = recording_load  # type: ignore[method-assign]
    trainer = Trainer(
        make_model(seed=0, width=256), config(out, **settings), train_dataset=regression_data(200), callbacks=[pace]
    )
    trainer.fit(resume_from_checkpoint="if_exists")  # the first child finds no checkpoint
    payload = {"weights": trainer.model.state_dict(), "history": numeric_history(trainer)}
    torch.save(payload, result + ".tmp")
    os.replace(result + ".tmp", result)


def main(run_child: Callable[..., None] = child) -> None:
    """Serve `run ARGS...` lines: fork a child that calls `run_child(*ARGS)`; answer its pid and exit status."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # pay torch's lazy optimizer imports once, here
    print("ready", flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "run":
            continue
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                run_child(*parts[1:])
                code = 0
            finally:
                os._exit(code)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main()
