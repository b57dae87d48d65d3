"""Helpers for tests that start real 2-process jobs (gloo on CPU). Every subprocess runs under a
timeout; a failed job's output is shown in the assertion message."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.world import python_path, run_world

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def run(
    cmd: list[str], timeout: float = 120, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `cmd` from the repository root; returns the process with `.elapsed` seconds set."""
    full_env = {
        **os.environ,
        "PYTHONPATH": python_path(),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    proc.elapsed = time.perf_counter() - start  # type: ignore[attr-defined]
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, cmd))} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def torchrun(script: str, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """`script` on a 2-process world as torchrun starts it (tests/world.py: without its start-up cost)."""
    return run_world(HERE / script, *args, timeout=timeout, check=check)


def real_torchrun(script: str, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """`script` under torchrun itself: for what only a real process shows (its interpreter's finalization)."""
    return run([*TORCHRUN, str(HERE / script), *map(str, args)], timeout=timeout, check=check)


def kiln_cli(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "kiln.cli", *map(str, args)], timeout=timeout, check=check)
