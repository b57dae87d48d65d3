"""The checkpoint write in flight (`save.async_save`): one at a time, on a thread of its own.

At the step boundary the manager stages the state in host memory and hands the rest of the save (the
big files, fsync, the COMPLETE marker, the rename, rotation, an upload) to `BackgroundSave.start`.
Training goes on. The thread never runs a collective on the training's process group: a full-state
format's files are written by the writer ranks' threads (the other ranks' have nothing to write); a
sharded format's thread on every rank waits for that rank's files (DCP's async_save, whose collectives
run on a process group of their own), and the writer's then writes COMPLETE. The files every rank
writes (its RNG and loop state, a few KiB) are written before the ranks' barrier, on the training
thread. A failure is kept, not raised on the thread; the manager raises it, in the same
sentence a synchronous save would, at its next `wait()`: before the next save, at the end of fit, or
at a preemption. Nothing already saved is touched by a failed save (its temporary folder is removed).

The thread is not a daemon: a process that ends while a save is in flight (an exception in training)
finishes writing it first, so the checkpoint it had staged still lands."""

from __future__ import annotations

import threading
from collections.abc import Callable


class BackgroundSave:
    """Runs one checkpoint job at a time on a thread and keeps its failure for `join`."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.step: int | None = None  # the step of the save in flight (or of the last one)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    @property
    def running(self) -> bool:
        """Whether the save in flight is still being written (a finished one waits for `join`)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, step: int, job: Callable[[], None]) -> None:
        """Run `job` on a new thread; the previous one must have been joined."""
        assert self._thread is None, "a checkpoint save is already in flight"
        self.step = step
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"kiln-checkpoint-{step}")
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as err:  # kept for join(): the training thread raises it
            self._error = err

    def finish(self) -> None:
        """Wait for the save in flight, if any; its failure stays for `join`."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def join(self) -> BaseException | None:
        """Wait for the save in flight, if any; return (and forget) its failure."""
        self.finish()
        error, self._error = self._error, None
        return error
