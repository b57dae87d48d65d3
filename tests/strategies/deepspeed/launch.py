"""Start one of this folder's 2-process workers (gloo on CPU) and read back what rank 0 wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def launch_worker(script: str, out: Path, *checks: str) -> tuple[dict, dict]:
    """(results.json, tensors.safetensors) of `torchrun --nproc_per_node=2 script out checks...`."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(HERE / script),
        str(out),
        *checks,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    if proc.returncode != 0:
        pytest.fail(f"worker exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    from safetensors.torch import load_file

    return json.loads((out / "results.json").read_text()), load_file(str(out / "tensors.safetensors"))
