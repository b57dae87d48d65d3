"""Under 2-process DDP exactly one tracker run / history exists, written by global rank 0, and it
holds rank 0's (already reduced) log_history once."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import pytest

from tests.world import run_world

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_two_processes_write_one_run(tmp_path):
    pytest.importorskip("tensorboard")
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    out = tmp_path / "out"
    run_world(Path(__file__).with_name("ddp_worker.py"), out, timeout=240)

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
