"""Who may write into an `output_dir`: one run at a time, and never over a finished run's work.

Two runs writing into one folder interleave their checkpoints (and one run's rotation deletes the
other's files), so a run holds an exclusive lock on `output_dir/.kiln-run.lock` from the start of
`fit()` to its end (and while `save_model` writes). The lock is an `flock`: the kernel drops it when
the holding process exits or is killed, so a crashed run never blocks the next one; the file then
still names the dead holder, and taking it over is logged. Only the job's writer (global rank 0, or
each node's local rank 0 with `save.on_each_node`) takes it; the other ranks learn the outcome
through one collective, so every rank raises the same sentence.

A new run (not resuming) into a folder that holds checkpoints or an exported model is refused whatever
the save settings are: a run with `save.strategy: no` still exports `model.safetensors` and
`trainer_state.json` over the old ones."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kiln.engine.checkpoint.in_use import FINISHED_FILES, LOCK, OutputDirInUse
from kiln.engine.checkpoint.remote_run import store_of
from kiln.utils.errors import ConfigError, KilnError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.strategies.base import Strategy

log = logging.getLogger(__name__)

#: locks this process holds: real path -> [file descriptor, how many nested holders]
_held: dict[str, list[int]] = {}


def _holder(fd: int) -> dict[str, Any] | None:
    """What the lock file says of the process that holds (or last held) it."""
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw.decode("utf-8")) if raw else None
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _holder_text(fd: int) -> str:
    info = _holder(fd)
    if info is None:
        return "another process"
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')}, started {when}"


def acquire(output_dir: str) -> None:
    """Take the run lock of `output_dir` (re-entrant within this process); raises OutputDirInUse
    naming the holder when another live process has it."""
    import fcntl

    os.makedirs(output_dir, exist_ok=True)
    key = os.path.realpath(output_dir)
    if key in _held:
        _held[key][1] += 1
        return
    path = os.path.join(key, LOCK)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(fd)
            os.close(fd)
            raise OutputDirInUse(
                f"output_dir {output_dir!r} is in use by another kiln run ({holder}); wait for it to finish, or pick "
                "another output_dir."
            ) from None
        # The releasing process unlinks the file: a lock taken on an unlinked file guards nothing.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    previous = _holder(fd)
    if previous and previous.get("pid") != os.getpid():
        log.warning(
            "Took over the run lock of %s left by pid %s on %s, which is no longer running (it crashed or was killed).",
            output_dir,
            previous.get("pid", "?"),
            previous.get("host", "?"),
        )
    info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode("utf-8")
    os.ftruncate(fd, 0)
    os.pwrite(fd, info, 0)
    _held[key] = [fd, 1]


def release(output_dir: str) -> None:
    """Drop one hold on the lock; the last one removes the file and unlocks."""
    key = os.path.realpath(output_dir)
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] > 0:
        return
    del _held[key]
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(key, LOCK))
    os.close(entry[0])  # closing the descriptor drops the flock


def is_writer(config: DictConfig, strategy: Strategy) -> bool:
    return strategy.is_global_zero or bool(config.save.on_each_node and strategy.is_local_zero)


@contextlib.contextmanager
def run_lock(config: DictConfig, strategy: Strategy) -> Iterator[None]:
    """Hold `config.output_dir`'s run lock (on the writer rank) for the block; every rank raises the
    writer's refusal."""
    out = str(config.output_dir)
    error: tuple[bool, str] | None = None  # (refused by the store's kind, the sentence)
    writer = is_writer(config, strategy)
    store = store_of(config) if strategy.is_global_zero else None  # save.remote_dir: its lock too
    remote_held = False
    if writer:
        try:
            acquire(out)
            if store is not None:
                store.acquire_lock()
                remote_held = True
        except (OutputDirInUse, ConfigError) as err:
            error = (isinstance(err, ConfigError), str(err))
    if strategy.world_size > 1:
        errors = [e for e in strategy.all_gather_object(error) if e]
        error = errors[0] if errors else None
    if error is not None:
        if writer and os.path.realpath(out) in _held:  # another node's writer was refused: give ours back
            release(out)
        if remote_held:
            assert store is not None
            store.release_lock()
        raise ConfigError(error[1]) if error[0] else OutputDirInUse(error[1])
    try:
        yield
    finally:
        if writer:
            release(out)
        if store is not None:
            store.release_lock()


def finished_work(output_dir: str) -> str | None:
    """The first thing in `output_dir` a new run would overwrite (a checkpoint or an exported model), or None."""
    from kiln.engine.checkpoint.files import list_checkpoints

    checkpoints = list_checkpoints(output_dir)
    if checkpoints:
        return os.path.basename(checkpoints[-1][1])
    for name in FINISHED_FILES:
        if os.path.exists(os.path.join(output_dir, name)):
            return name
    return None


def refuse_overwrite(config: DictConfig) -> None:
    """A fresh run (not resuming) must not write over a finished run's checkpoints or exported model. The
    sentence names the way a script can say `overwrite_output_dir` whose settings are transformers 5's
    TrainingArguments, which raise TypeError for it: kiln's keys ride beside them as `overrides`."""
    if config.overwrite_output_dir:
        return
    store = store_of(config)
    where = store.url if store is not None else str(config.output_dir)
    found = store.finished_work() if store is not None else None
    found = found or finished_work(str(config.output_dir))
    if found is not None:
        raise KilnError(
            f"output_dir {where!r} already holds checkpoints or an exported model ({found}, ...). Resume with "
            "resume_from_checkpoint=true, pick another output_dir, or set overwrite_output_dir=true (from a script "
            'with TrainingArguments, which no longer take it: Trainer(..., overrides=["overwrite_output_dir=true"])).'
        )
