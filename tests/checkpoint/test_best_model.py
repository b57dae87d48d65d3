"""Best-model tracking: `metric_for_best_model` with or without the `eval_` prefix, HF's
`greater_is_better` defaults, `load_best_model_at_end` restoring the best weights (also across a
resume), the start-up checks on incompatible strategies, and rotation that never drops the best."""

from __future__ import annotations

import os

import pytest
import torch

from kiln.config import ConfigError
from kiln.engine.trainer import Trainer
from kiln.strategies.model_weights import load_weights
from tests.checkpoint.checkpoint_helpers import (
    Crash,
    Scripted,
    config,
    folders,
    make_model,
    regression_data,
    train,
    weights,
)


def small_eval():
    return regression_data(8, seed=5)


def best_run(out, scores, name="score", resume=None, crash_at=None, **cfg):
    base = {
        "max_steps": 2 * len(scores),
        "save_steps": 2,
        "eval_strategy": "steps",
        "eval_steps": 2,
        "metric_for_best_model": name,
    }
    base.update(cfg)
    return train(
        out,
        base,
        eval_data=small_eval,
        compute_metrics=Scripted(scores, name.removeprefix("eval_")),
        resume=resume,
        crash_at=crash_at,
    )


@pytest.mark.parametrize("name", ["score", "eval_score"])
def test_metric_name_with_or_without_eval_prefix(tmp_path, name):
    trainer = best_run(str(tmp_path / "run"), [0.2, 0.9, 0.5, 0.7], name=name)
    assert trainer.state.best_metric == 0.9 and trainer.state.best_global_step == 4
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-4")


@pytest.mark.parametrize(
    "metric, explicit, expected",
    [
        (None, None, False),
        ("loss", None, False),
        ("eval_loss", None, False),
        ("nll_loss", None, False),
        ("accuracy", None, True),
        ("eval_f1", None, True),
        ("loss", True, True),
        ("accuracy", False, False),
    ],
)
def test_greater_is_better_defaults_follow_hf(tmp_path, metric, explicit, expected):
    trainer = Trainer(
        make_model(),
        config(str(tmp_path), metric_for_best_model=metric, greater_is_better=explicit),
        train_dataset=regression_data(),
    )
    assert trainer.greater_is_better() is expected


def test_lower_is_better_for_a_loss_metric(tmp_path):
    trainer = best_run(str(tmp_path / "run"), [0.5, 0.1, 0.3], name="nll_loss")
    assert trainer.state.best_metric == 0.1 and trainer.state.best_global_step == 4


def test_load_best_model_at_end_restores_the_best_weights(tmp_path):
    out = str(tmp_path / "run")
    trainer = best_run(out, [0.2, 0.9, 0.5, 0.7], load_best_model_at_end=True)
    best = load_weights(os.path.join(out, "checkpoint-4"))
    last = load_weights(os.path.join(out, "checkpoint-8"))
    now = weights(trainer)
    assert all(torch.equal(now[k], best[k]) for k in now)
    assert not all(torch.equal(now[k], last[k]) for k in now)


def test_best_tracking_survives_a_resume(tmp_path):
    out = str(tmp_path / "run")
    scores = [0.2, 0.9, 0.5, 0.7, 0.6]
    straight = best_run(str(tmp_path / "straight"), scores, load_best_model_at_end=True)
    with pytest.raises(Crash):
        best_run(out, scores, load_best_model_at_end=True, crash_at=6)
    resumed = best_run(out, scores[3:], load_best_model_at_end=True, resume=True, max_steps=10)
    assert resumed.state.best_global_step == 4 and resumed.state.best_metric == 0.9
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "limit, scores, expected",
    [
        # best at step 4; saves at 2, 4, ..., 12
        (2, [0.2, 0.9, 0.5, 0.7, 0.6, 0.4], {4, 12}),  # the best plus the newest
        (1, [0.2, 0.9, 0.5, 0.7, 0.6, 0.4], {4, 12}),  # limit 1 keeps the last and the best (HF)
        (3, [0.2, 0.9, 0.5, 0.7, 0.6, 0.4], {4, 10, 12}),  # the best counts towards the limit
        (2, [0.2, 0.3, 0.5, 0.7, 0.8, 0.9], {10, 12}),  # the best is the newest: just the two newest
        (1, [0.2, 0.3, 0.5, 0.7, 0.8, 0.9], {12}),
    ],
)
def test_rotation_keeps_exactly_the_newest_and_the_best(tmp_path, limit, scores, expected):
    out = str(tmp_path / "run")
    best_run(out, scores, save_total_limit=limit)
    assert folders(out) == {f"checkpoint-{s}" for s in expected}


def test_rotation_without_best_tracking_keeps_the_newest(tmp_path):
    out = str(tmp_path / "run")
    train(out, {"max_steps": 12, "save_steps": 2, "save_total_limit": 2})
    assert folders(out) == {"checkpoint-10", "checkpoint-12"}


@pytest.mark.parametrize(
    "cfg, message",
    [
        (
            {"load_best_model_at_end": True},
            "load_best_model_at_end needs evaluation during training: set eval.strategy",
        ),
        (
            {"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "epoch"},
            "needs save.strategy ('epoch') to match eval.strategy ('steps')",
        ),
        (
            {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 4, "save_steps": 6},
            "save.steps (6) to be a multiple of eval.steps (4)",
        ),
    ],
)
def test_incompatible_best_model_settings_fail_at_start_up(tmp_path, cfg, message):
    with pytest.raises(ConfigError) as err:
        Trainer(make_model(), config(str(tmp_path), **cfg), train_dataset=regression_data())
    assert message in str(err.value)


def test_save_strategy_best_with_load_best_is_accepted(tmp_path):
    trainer = best_run(str(tmp_path / "run"), [0.2, 0.9, 0.5], save_strategy="best", load_best_model_at_end=True)
    assert folders(trainer.config.output_dir) == {"checkpoint-2", "checkpoint-4"}
