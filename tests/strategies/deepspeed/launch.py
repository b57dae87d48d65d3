"""Start this folder's 2-process worker chain (gloo on CPU): see conftest.py's `ds_world`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def start(script: str, *args: str) -> None:
    """`torchrun --nproc_per_node=2 script args...`; a failure fails the test with the workers' output."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(HERE / script)]
    proc = subprocess.run([*cmd, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=2400)
    if proc.returncode != 0:
        pytest.fail(f"worker exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
