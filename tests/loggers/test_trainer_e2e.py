"""A short real Trainer run: every file a logger wrote holds exactly `trainer.state.log_history` plus the
throughput figures (which log_history leaves out, as HF does), the run files live under the logging
directory, and a killed-and-resumed run writes the same histories as one that never stopped."""

from __future__ import annotations

import glob
import json
import math
import os
import re

import pytest
import torch

from kiln import Callback, Trainer
from kiln.loggers.base import grouped_name
from tests.helpers import TinyRegressor, regression_data

TIMING = re.compile(r"_runtime$|per_second$")


def config(tmp_path, **extra):
    cfg = {
        "output_dir": str(tmp_path / "out"),
        "run_name": "e2e",
        "max_steps": 8,
        "learning_rate": 1e-2,
        "per_device_train_batch_size": 4,
        "report_to": ["tensorboard", "csv", "jsonl"],
        "log": {"steps": 2, "history": [], "disable_tqdm": True},
        "eval": {"strategy": "steps", "steps": 4},
        "save": {"strategy": "no"},
        "strategy": {"device": "cpu"},
    }
    cfg.update(extra)
    return cfg


def numeric(entry):
    return {k: v for k, v in entry.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def read_jsonl(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def read_csv_rows(path):
    import csv

    with open(path, newline="") as fh:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(fh)]


def tensorboard_scalars(output_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [run] = [d for d in glob.glob(os.path.join(output_dir, "runs", "*")) if os.path.isdir(d)]
    acc = EventAccumulator(run, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_every_file_matches_the_log_history(tmp_path):
    pytest.importorskip("tensorboard")
    trainer = Trainer(
        TinyRegressor(), config(tmp_path), train_dataset=regression_data(64), eval_dataset=regression_data(16, seed=1)
    )
    trainer.fit()
    history = [numeric(h) for h in trainer.state.log_history]
    assert any("eval_loss" in h for h in history) and "train_runtime" in history[-1]
    out = trainer.config.output_dir

    assert not os.path.exists(f"{out}/metrics.jsonl") and not os.path.exists(
        f"{out}/metrics.csv"
    )  # not beside checkpoints
    steps = [h for h in history if "loss" in h]
    assert steps and all(set(h) == {"loss", "grad_norm", "learning_rate", "epoch", "step"} for h in steps)  # HF's keys
    rows = read_jsonl(f"{out}/runs/metrics.jsonl")
    assert [{k: v for k, v in r.items() if k in h or k == "step"} for r, h in zip(rows, history)] == [
        {"step": h["step"], **h} for h in history
    ] and len(rows) == len(history)
    assert all(
        "samples_per_second" in r and "steps_per_second" in r for r in rows if "loss" in r
    )  # loggers keep throughput
    csv_rows = read_csv_rows(f"{out}/runs/metrics.csv")
    assert [{k: v for k, v in r.items() if k in h} for r, h in zip(csv_rows, history)] == [
        {k: float(v) for k, v in h.items()} for h in history
    ]
    scalars = tensorboard_scalars(out)
    names = {k for r in rows for k in r if k != "step"}
    assert set(scalars) == {grouped_name(k) for k in names}
    for name in names:
        want = [(h["step"], h[name]) for h in rows if name in h]
        got = scalars[grouped_name(name)]
        assert [s for s, _ in got] == [s for s, _ in want], name
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), name  # float32 events


class Kill(Callback):
    def on_step_end(self, config, state, control, **kw):
        if state.global_step == 7:
            raise KeyboardInterrupt("killed")


def model() -> TinyRegressor:
    """The same initial weights for every run of a test, whatever the global RNG went through before."""
    torch.manual_seed(0)
    return TinyRegressor()


def without_timing(rows):
    return [{k: v for k, v in row.items() if not TIMING.search(k)} for row in rows]


def test_kill_and_resume_writes_the_uninterrupted_histories(tmp_path):
    pytest.importorskip("tensorboard")
    data, evals = regression_data(64), regression_data(16, seed=1)
    save = {"strategy": "steps", "steps": 4}
    Trainer(model(), config(tmp_path / "a", save=save), train_dataset=data, eval_dataset=evals).fit()

    cfg = config(tmp_path / "b", save=save)
    with pytest.raises(KeyboardInterrupt):
        Trainer(model(), cfg, train_dataset=data, eval_dataset=evals, callbacks=[Kill()]).fit()
    killed = read_jsonl(f"{cfg['output_dir']}/runs/metrics.jsonl")
    assert max(r["step"] for r in killed) == 6  # logged past the checkpoint at step 4
    Trainer(model(), cfg, train_dataset=data, eval_dataset=evals).fit(resume_from_checkpoint=True)

    a, b = (read_jsonl(f"{tmp_path / d}/out/runs/metrics.jsonl") for d in "ab")
    assert [r["step"] for r in b] == [r["step"] for r in a]
    assert [sorted(r) for r in b] == [sorted(r) for r in a]
    for ra, rb in zip(without_timing(a), without_timing(b), strict=True):
        assert rb == pytest.approx(ra, rel=1e-5, abs=1e-8)
    header = lambda d: open(f"{tmp_path / d}/out/runs/metrics.csv").readline()  # noqa: E731
    assert header("b") == header("a")
    tb_a, tb_b = (tensorboard_scalars(f"{tmp_path / d}/out") for d in "ab")
    assert {k: [s for s, _ in v] for k, v in tb_b.items()} == {k: [s for s, _ in v] for k, v in tb_a.items()}
    assert not any(math.isnan(v) for _, v in tb_b["train/loss"])
