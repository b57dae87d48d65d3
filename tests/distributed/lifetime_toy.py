"""`task.data` and helpers for the tests of the `kiln fit --nproc` launcher's lifetime (kill -9,
SIGTERM, sockets): each worker says when it trains, and steps can be made slow, so a test can signal
the launcher at a known point instead of guessing with sleeps."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil

from kiln import Callback
from tests.distributed.toy import cli_data


class Beacon(Callback):
    """At the end of step `step`, each rank writes its pid to `<folder>/rank<r>` (atomically): the
    test then knows that every worker is training."""

    def __init__(self, folder: str, step: int) -> None:
        self.folder, self.step = folder, step

    def on_step_end(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            rank = os.environ.get("RANK", "0")
            tmp = os.path.join(self.folder, f".rank{rank}")
            with open(tmp, "w") as fh:
                fh.write(str(os.getpid()))
            os.replace(tmp, os.path.join(self.folder, f"rank{rank}"))


class SlowSteps(Callback):
    """Every step after `after` lasts `seconds` longer (a long forward/backward, as the callback is
    inside the step as far as the preemption check is concerned)."""

    def __init__(self, after: int, seconds: float) -> None:
        self.after, self.seconds = after, seconds

    def on_step_end(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step > self.after:
            time.sleep(self.seconds)


class DeafToCtrlC(Callback):
    """Rank `rank` ignores SIGINT from the start of training: the agent's forwarded Ctrl-C reaches the
    other ranks only, as when this rank's own signal comes late."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_begin(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        if os.environ.get("RANK") == str(self.rank):
            signal.signal(signal.SIGINT, lambda signum, frame: None)


def data(
    beacon: str = "", beacon_step: int = 2, slow_after: int = 0, slow_seconds: float = 0.0, deaf_rank: int = -1
) -> dict[str, Any]:
    """`task.data` for these tests: the CLI runs' regression data plus the callbacks above."""
    out = cli_data()
    if deaf_rank >= 0:
        out["callbacks"].append(DeafToCtrlC(deaf_rank))
    if beacon:
        out["callbacks"].append(Beacon(beacon, beacon_step))
    if slow_seconds:
        out["callbacks"].append(SlowSteps(slow_after, slow_seconds))
    return out


def write_config(path: str, output_dir: str, save_steps: int = 5, **data_args: Any) -> str:
    """A `kiln fit` config of a DDP run that would train for a long time (100000 steps)."""
    from omegaconf import OmegaConf

    cfg = {
        "output_dir": output_dir,
        "seed": 5,
        "learning_rate": 1e-2,
        "max_steps": 100000,
        "per_device_train_batch_size": 4,
        "save_steps": save_steps,
        "logging_steps": 1000,
        "disable_tqdm": True,
        "strategy": {"name": "ddp", "device": "cpu", "timeout": 60},
        "task": {
            "model": "tests.distributed.toy:cli_model",
            "data": "tests.distributed.lifetime_toy:data",
            "data_args": data_args,
        },
    }
    OmegaConf.save(OmegaConf.create(cfg), path)
    return path


def wait_for(predicate: Any, timeout: float, what: str, proc: Any = None) -> Any:
    """Poll `predicate()` until it returns something truthy; fail with `what` after `timeout` s (or
    as soon as `proc` has exited, with its output)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"{what}: the launcher exited {proc.returncode} first\n{out[-2000:]}\n{err[-4000:]}")
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout} s")


def workers_of(launcher: int) -> list[psutil.Process]:
    """The worker processes a `kiln fit --nproc` launcher started (its direct children running the shim)."""
    try:
        children = psutil.Process(launcher).children()
    except psutil.NoSuchProcess:
        return []
    return [c for c in children if "kiln.launch.worker" in " ".join(_cmdline(c))]


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def gone(pid: int) -> bool:
    """The process ended (a zombie, dead but not yet reaped by its new parent, counts as ended)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
