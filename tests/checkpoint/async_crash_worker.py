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
from collections.abc import Callable
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from kiln.strategies import full_checkpoint_io
from tests.checkpoint.crash_worker import main, quiet, train_and_record

CONFIG = {
    "max_steps": 48,
    "save_steps": 4,
    "logging_steps": 4,
    "save_total_limit": 2,
    "learning_rate": 0.02,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "save": {"async": True},
}


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
    torch.save, full_checkpoint_io.save_weights = counted(torch.save), counted(full_checkpoint_io.save_weights)


def child(out: str, result: str, kill_at: str) -> None:
    quiet()
    if int(kill_at):
        _kill_before(int(kill_at))
    train_and_record(out, result, CONFIG)


if __name__ == "__main__":
    main(child)
