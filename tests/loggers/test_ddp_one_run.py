"""Under 2-process DDP exactly one tracker run / history exists, written by global rank 0, and it
holds rank 0's (already reduced) log_history once."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_two_processes_write_one_run(tmp_path):
    pytest.importorskip("tensorboard")
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(Path(__file__).with_name("ddp_worker.py")),
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]

    runs = [d for d in glob.glob(str(out / "runs" / "*")) if os.path.isdir(d)]
    assert len(runs) == 1 and len(glob.glob(os.path.join(runs[0], "events.out.tfevents.*"))) == 1
    history = json.loads((out / "log_history.json").read_text())
    with open(out / "runs" / "metrics.jsonl") as fh:
        rows = [json.loads(line) for line in fh]
    # once each, not once per rank (the files add throughput to log_history's entries)
    assert [{k: v for k, v in r.items() if k in h or k == "step"} for r, h in zip(rows, history)] == [
        {"step": h["step"], **h} for h in history
    ] and len(rows) == len(history)
    assert len(open(out / "runs" / "metrics.csv").read().splitlines()) == len(history) + 1
