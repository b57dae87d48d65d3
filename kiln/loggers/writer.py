"""The background writer: one thread that runs the loggers' file and network writes in the order they
were queued, so a log event costs the training thread only building its record (a CSV row is ~40 µs,
a TensorBoard scalar ~0.6 ms, an MLflow metric over sqlite ~50 ms; see bench/log_cost.py).

One writer per process (`shared_writer()`), started on first use. `submit` only appends to a deque (a
GIL-atomic operation): it takes no lock and wakes no one, because waking the writer on every record
makes it compete with the training thread for the GIL right when the next step starts. The writer wakes
by itself every `WAKE_S` seconds and runs what has piled up. The queue is bounded: a logger slower than
the log rate makes the training thread wake the writer and wait, instead of holding an unbounded
backlog in memory.

`flush()` wakes the writer at once and waits until every queued write has run; the LoggerCallback
flushes before a checkpoint is saved and when training ends, the Trainer when fit() leaves (also
through an exception), and the exit hook at interpreter exit, so no record is lost. A write
that raised is re-raised on the training thread at its next call, as the write itself would have.

SIGTERM: where nothing else handles it (the default action, which kills the process at once), the
writer installs a handler that flushes (at most `SIGTERM_FLUSH_S` seconds) and then dies of SIGTERM as
before, so the exit status is unchanged. The handler is checked when a record is queued behind an
empty queue (once per batch of records: reading it costs more than queueing the record). Where
`save.on_preemption` handles it, the loop saves and
ends training as a finished run ends, and the Trainer flushes on its way out."""

from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

#: queued writes the training thread may run ahead of the writer by
QUEUE_SIZE = 1024
#: how often the writer wakes by itself to run what was queued (records reach disk at most this late)
WAKE_S = 0.25
#: how long a SIGTERM waits for queued writes (a tracker server that hangs must not keep the process alive)
SIGTERM_FLUSH_S = 30.0


class BackgroundWriter:
    def __init__(self, maxsize: int = QUEUE_SIZE, wake_s: float = WAKE_S) -> None:
        self.maxsize = maxsize
        self.wake_s = wake_s
        self._tasks: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        # Re-entrant: a SIGTERM handler flushing while the training thread waits for room in submit()
        # (holding it) must not deadlock.
        self._cond = threading.Condition(threading.RLock())
        self._busy = False  # the thread is running tasks it has taken off the queue
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue `fn(*args)`; waits while the queue is full. Raises an earlier write's error."""
        self._raise_error()
        # Once per batch of records, not per record (reading the SIGTERM handler costs ~15 µs): a record
        # queued behind others finds the handler and the thread as the first record of its batch left them.
        if not self._tasks:
            _flush_on_sigterm()
            if not self._start():  # no thread can be started (interpreter shutdown): write here
                self.flush()
                fn(*args)
                return
        if len(self._tasks) >= self.maxsize:
            self._wait_for_room()
        self._tasks.append((fn, args))

    def flush(self, timeout: float | None = None) -> None:
        """Run every queued write now and wait until they are done (or `timeout` seconds); raises the
        first error one of them raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            with self._cond:
                self._cond.notify_all()  # wake the writer now instead of at its next tick
                while (self._tasks or self._busy) and thread.is_alive():
                    if deadline is not None and time.monotonic() > deadline:
                        break
                    self._cond.wait(0.1)
        self._raise_error()

    def _wait_for_room(self) -> None:
        thread = self._thread
        with self._cond:
            self._cond.notify_all()
            while len(self._tasks) >= self.maxsize and thread is not None and thread.is_alive():
                self._cond.wait(0.1)

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _start(self) -> bool:
        if self._thread is not None and self._thread.is_alive():
            return True
        thread = threading.Thread(target=self._run, name="kiln-log-writer", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # "can't create new thread at interpreter shutdown"
            return False
        self._thread = thread
        return True

    def _run(self) -> None:
        tasks = self._tasks
        while True:
            with self._cond:
                if not tasks:
                    self._cond.wait(self.wake_s)  # a flush or a full queue wakes it early
                if not tasks:
                    continue
                self._busy = True
            try:
                while tasks:
                    fn, args = tasks.popleft()
                    try:
                        fn(*args)
                    except BaseException as err:  # kept for the training thread, which decides what it means
                        if self._error is None:
                            self._error = err
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


_WRITER: BackgroundWriter | None = None
_LOCK = threading.Lock()


def shared_writer() -> BackgroundWriter:
    """The process's writer (one thread for every LoggerCallback, so every record keeps its order)."""
    global _WRITER
    with _LOCK:
        if _WRITER is None:
            _WRITER = BackgroundWriter()
        return _WRITER


def flush_writes(timeout: float | None = None) -> None:
    """Wait for every queued log write (a no-op when nothing was ever queued)."""
    if _WRITER is not None:
        _WRITER.flush(timeout)


def flush_after_fit(error: BaseException | None) -> None:
    """Wait for the writer when fit() leaves. While `error` propagates, a failed write is logged
    instead of replacing it."""
    try:
        flush_writes()
    except Exception:
        if error is None:
            raise
        logging.getLogger(__name__).exception("A logger failed to write while training was failing")


def _on_sigterm(signum: int, frame: Any) -> None:
    """Write what is queued, then die of SIGTERM as the default action would have."""
    try:
        flush_writes(timeout=SIGTERM_FLUSH_S)
    except BaseException:  # a failed write must not keep the process alive
        pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _flush_on_sigterm() -> None:
    """Install the flushing handler where SIGTERM still has its default action (main thread only;
    a handler someone else installed, e.g. kiln's preemption, is left alone)."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
