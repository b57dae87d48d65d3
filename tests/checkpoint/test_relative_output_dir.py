"""A relative `output_dir` (HF's default `tmp_trainer` is one) works like an absolute one: rotation
keeps the best checkpoint, load_best_model_at_end restores it, and resume finds the newest one.
Each test first changes into a temporary folder, as a user running from their project folder would."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from kiln.engine.trainer import Trainer
from kiln.strategies.model_weights import load_weights
from tests.checkpoint.checkpoint_helpers import (
    Crash,
    CrashAfterSave,
    Scripted,
    config,
    folders,
    make_model,
    regression_data,
    weights,
)

# spellings of one relative folder; None leaves output_dir unset (the default, tmp_trainer)
SPELLINGS = ["run", "./run", "run/", "sub/../run", None]


def best_run(
    output_dir: str | None, scores: list[float], resume: Any = None, crash_at: int | None = None, **overrides: Any
) -> Trainer:
    """Evaluate and save every 2 steps; `scores` are the scripted metric values (greater is better)."""
    cfg = config(
        output_dir or "unused",
        **{
            "max_steps": 2 * len(scores),
            "save_steps": 2,
            "eval_strategy": "steps",
            "eval_steps": 2,
            "metric_for_best_model": "score",
            **overrides,
        },
    )
    if output_dir is None:
        del cfg["output_dir"]
    trainer = Trainer(
        make_model(),
        cfg,
        train_dataset=regression_data(),
        eval_dataset=regression_data(8, seed=5),
        compute_metrics=Scripted(scores),
        callbacks=[CrashAfterSave(crash_at)] if crash_at else [],
    )
    trainer.fit(resume_from_checkpoint=resume)
    return trainer


def _where(output_dir: str | None) -> str:
    return os.path.normpath(output_dir or "tmp_trainer")


@pytest.mark.parametrize("output_dir", SPELLINGS)
@pytest.mark.parametrize(
    "limit, scores, expected",
    [
        (2, [0.2, 0.9, 0.5, 0.7, 0.6, 0.4], {4, 12}),  # the best (step 4) plus the newest
        (1, [0.2, 0.9, 0.5, 0.7, 0.6, 0.4], {4, 12}),
        (3, [0.2, 0.9, 0.5, 0.7, 0.6, 0.4], {4, 10, 12}),
    ],
)
def test_rotation_keeps_the_best_with_a_relative_output_dir(tmp_path, monkeypatch, output_dir, limit, scores, expected):
    monkeypatch.chdir(tmp_path)
    trainer = best_run(output_dir, scores, save_total_limit=limit)
    assert trainer.config.output_dir == (output_dir or "tmp_trainer")  # kept as given, not made absolute
    assert folders(str(tmp_path / _where(output_dir))) == {f"checkpoint-{s}" for s in expected}
    assert trainer.state.best_global_step == 4
    assert os.path.samefile(trainer.state.best_model_checkpoint, tmp_path / _where(output_dir) / "checkpoint-4")


@pytest.mark.parametrize("output_dir", ["run", None])
def test_load_best_model_at_end_with_a_relative_output_dir(tmp_path, monkeypatch, output_dir):
    monkeypatch.chdir(tmp_path)
    trainer = best_run(output_dir, [0.2, 0.9, 0.5, 0.7], load_best_model_at_end=True, save_total_limit=1)
    best = load_weights(str(tmp_path / _where(output_dir) / "checkpoint-4"))
    now = weights(trainer)
    assert all(torch.equal(now[k], best[k]) for k in now)
    assert folders(str(tmp_path / _where(output_dir))) == {"checkpoint-4", "checkpoint-8"}


def test_resume_with_a_relative_output_dir_keeps_tracking_the_best(tmp_path, monkeypatch):
    """Killed after step 6 and resumed (resume_from_checkpoint=true finds the newest checkpoint in the
    relative folder); with limit 1, the best of before the crash (step 4) must survive every later rotation."""
    monkeypatch.chdir(tmp_path)
    scores = [0.2, 0.9, 0.5, 0.7, 0.6]
    straight = best_run("straight", scores, load_best_model_at_end=True, save_total_limit=1)
    with pytest.raises(Crash):
        best_run("run", scores, load_best_model_at_end=True, save_total_limit=1, crash_at=6)
    resumed = best_run("run", scores[3:], load_best_model_at_end=True, save_total_limit=1, resume=True, max_steps=10)
    assert resumed.state.best_global_step == 4 and resumed.state.best_metric == 0.9
    assert folders(str(tmp_path / "run")) == folders(str(tmp_path / "straight")) == {"checkpoint-4", "checkpoint-10"}
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
