"""Ctrl-C on `kiln fit --nproc 2` (SIGINT to the whole process group, as a terminal sends it): one line
saying where training stopped and the last checkpoint, exit code 130, no traceback from any process,
also when rank 0's own signal comes after rank 1 has already stopped (torch's agent forwards SIGINT
to the workers one by one)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.distributed.conftest import REPO
from tests.distributed.lifetime_toy import write_config
from tests.distributed.toy import write_cli_config

pytestmark = pytest.mark.distributed


def _interrupt(cfg: str, tmp_path: Any) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", "fit", cfg, "--nproc", "2", "max_steps=100000"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (tmp_path / "run" / "checkpoint-3" / "COMPLETE").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err


def _assert_interrupted(code: int, err: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 130, err[-3000:]
    assert len(lines) == 1, err[-3000:]
    match = re.fullmatch(r"kiln: interrupted at step (\d+); last checkpoint: (.*checkpoint-(\d+))", lines[0])
    assert match, lines
    assert int(match.group(1)) >= int(match.group(3)) >= 3 and os.path.isfile(os.path.join(match.group(2), "COMPLETE"))


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path):
    _assert_interrupted(*_interrupt(write_cli_config(str(tmp_path / "c.yaml"), str(tmp_path / "run")), tmp_path))


def test_a_peers_ctrl_c_is_the_interrupt_on_a_rank_whose_signal_is_late(tmp_path):
    # rank 0 never sees its SIGINT: its collective fails on rank 1's closed socket, and that failure is the interrupt
    cfg = write_config(str(tmp_path / "c.yaml"), str(tmp_path / "run"), save_steps=3, deaf_rank=0)
    _assert_interrupted(*_interrupt(cfg, tmp_path))
