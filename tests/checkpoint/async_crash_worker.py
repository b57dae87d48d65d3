"""A training process for the asynchronous-save kill test, driven over stdin/stdout like crash_worker.

`run OUT RESULT K` forks a child that trains with `save.async_save` and `resume_from_checkpoint="if_exists"`
into OUT, and kills itself with SIGKILL right before the K-th file-system step of its background
checkpoint writes (K = 0: never): writing the weights, the optimizer file, each fsync (files, folders,
the marker), the rename into place, each removal of rotation. Every kill lands at a known point inside
a background write, from the same trigger as the real thing, with no environment variable. A finished
child writes its final weights and numeric log history to RESULT."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from typing import Any, Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from kiln.engine.checkpoint import manager as checkpoint
from kiln.strategies import checkpoint_io
from tests.checkpoint.checkpoint_helpers import config, make_model, numeric_history, regression_data
from tests.checkpoint.crash_worker import Pace

CONFIG = {"max_steps": 48, "save_steps": 4, "logging_steps": 4, "save_total_limit": 2, "learning_rate": 0.02,
          "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "save": {"async": True}}


def _in_background() -> bool:
    return threading.current_thread().name.startswith(("kiln-checkpoint-", "kiln-fsync"))


def _kill_before(kill_at: int) -> None:
    """Count the background write's file-system steps; SIGKILL this process right before step `kill_at`."""
    lock, seen = threading.Lock(), [0]

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            if _in_background():
                with lock:
                    seen[0] += 1
                    if seen[0] == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return step

    os.fsync, os.replace, shutil.rmtree = counted(os.fsync), counted(os.replace), counted(shutil.rmtree)
    torch.save, checkpoint_io.save_weights = counted(torch.save), counted(checkpoint_io.save_weights)


def child(out: str, result: str, kill_at: int) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    torch.set_num_threads(1)
    if kill_at:
        _kill_before(kill_at)
    from kiln.engine.trainer import Trainer

    pace = Pace(os.path.dirname(out))
    load = checkpoint.CheckpointManager.load

    def recording_load(self, path):  # type: ignore[no-untyped-def]
        pace.loaded = os.path.basename(path)
        return load(self, path)

    checkpoint.CheckpointManager.load = recording_load  # type: ignore[method-assign]
    trainer = Trainer(make_model(seed=0, width=256), config(out, **CONFIG), train_dataset=regression_data(200),
                      callbacks=[pace])
    trainer.fit(resume_from_checkpoint="if_exists")
    payload = {"weights": trainer.model.state_dict(), "history": numeric_history(trainer)}
    with open(result + ".tmp", "wb") as fh:
        torch.save(payload, fh)
    os.replace(result + ".tmp", result)


def main() -> None:
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # pay torch's lazy optimizer imports once, here
    print("ready", flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "run":
            continue
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                child(parts[1], parts[2], int(parts[3]))
                code = 0
            finally:
                os._exit(code)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main()
