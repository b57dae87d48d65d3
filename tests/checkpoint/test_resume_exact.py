"""Bitwise resume: train N steps straight vs. stop right after the checkpoint at step k and resume in a
fresh Trainer with a fresh, differently initialised model (as after a crash). Final weights must be
`torch.equal` and the logged numbers (loss, grad_norm, learning_rate, epoch, eval_loss, train_loss)
identical. Every case has dropout, so the RNG streams must be restored too."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint.checkpoint_helpers import (
    StatefulStream,
    Stream,
    numeric_history,
    regression_data,
    straight_vs_resumed,
    weights,
)


def small_eval():
    return regression_data(12, seed=5)


CASES = {
    # 40 samples / batch 4 = 10 batches per epoch; logging every 3 steps never lines up with the save
    "mid-epoch": ({"max_steps": 25, "save_steps": 13}, 13, regression_data, None),
    "epoch-boundary-step-save": (
        {"max_steps": 25, "save_steps": 10, "eval_strategy": "epoch"},
        10,
        regression_data,
        small_eval,
    ),
    "epoch-boundary-epoch-save": (
        {"num_train_epochs": 3, "max_steps": -1, "save_strategy": "epoch", "eval_strategy": "epoch"},
        20,
        regression_data,
        small_eval,
    ),
    # accumulation 3 over 10 batches: windows of 3, 3, 3 and a shorter 1 -> 4 steps per epoch
    "accumulation-3-mid-epoch": (
        {"max_steps": 10, "save_steps": 2, "gradient_accumulation_steps": 3},
        6,
        regression_data,
        None,
    ),
    "accumulation-3-after-short-window": (
        {"max_steps": 10, "save_steps": 2, "gradient_accumulation_steps": 3},
        4,
        regression_data,
        None,
    ),
    "reduce-on-plateau-with-eval": (
        {
            "max_steps": 20,
            "save_steps": 4,
            "eval_strategy": "steps",
            "eval_steps": 2,
            "lr_scheduler_type": "reduce_lr_on_plateau",
            "lr_scheduler_kwargs": {"patience": 0, "factor": 0.5, "threshold": 0.3},
        },
        8,
        regression_data,
        small_eval,
    ),
    "heavy-dropout-warmup-cosine": (
        {"max_steps": 18, "save_steps": 7, "lr_scheduler_type": "cosine", "warmup_steps": 5},
        7,
        regression_data,
        None,
    ),
    # 30 items / batch 4 = 8 batches per pass (the last one of 2); max_steps needed: no length
    "iterable-with-state_dict": ({"max_steps": 14, "save_steps": 5}, 5, StatefulStream, None),
    "iterable-without-state_dict": ({"max_steps": 14, "save_steps": 5}, 5, Stream, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bitwise_identical(tmp_path, case):
    cfg, crash_at, data, eval_data = CASES[case]
    model_kw = {"dropout": 0.6} if "dropout" in case else None
    straight, resumed = straight_vs_resumed(tmp_path, cfg, crash_at, data, eval_data, model_kw=model_kw)
    assert resumed.state.global_step == straight.state.global_step
    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{case}: {name} differs after resume"
    history = numeric_history(straight)
    assert numeric_history(resumed) == history
    assert any("loss" in e for e in history) and history[-1].get("train_loss") is not None
    if eval_data is not None:
        assert any("eval_loss" in e for e in history)


def test_plateau_case_really_changes_the_learning_rate(tmp_path):
    """The reduce-on-plateau case only proves something if the scheduler acted before and after k."""
    cfg, crash_at, data, eval_data = CASES["reduce-on-plateau-with-eval"]
    straight, _ = straight_vs_resumed(tmp_path, cfg, crash_at, data, eval_data)
    lrs = [e["learning_rate"] for e in numeric_history(straight) if "learning_rate" in e]
    assert len(set(lrs)) >= 2, lrs


def test_resume_from_the_final_checkpoint_trains_nothing_more(tmp_path):
    from tests.checkpoint.checkpoint_helpers import train

    out = str(tmp_path / "run")
    first = train(out, {"max_steps": 10, "save_steps": 5}, regression_data)
    again = train(out, {"max_steps": 10, "save_steps": 5}, regression_data, model_seed=99, resume=True)
    assert again.state.global_step == 10
    a, b = weights(first), weights(again)
    assert all(torch.equal(a[n], b[n]) for n in a)
