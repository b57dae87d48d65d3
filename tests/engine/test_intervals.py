"""`logging_steps` / `eval_steps` / `save_steps` given as a ratio of the total steps that does not divide
it: HF rounds max_steps * ratio up (`math.ceil`, float product included), then acts on every multiple
of the result. max_steps=10 with 0.25 is every 3 steps: 3, 6, 9 (not 2.5 -> 2 or 3 -> every 2.5)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from kiln import Trainer
from tests.helpers import TinyRegressor, base_config, regression_data

# (max_steps, ratio, interval HF computes, steps that are multiples of it) -- written out by hand
CASES = [
    (10, 0.25, 3, [3, 6, 9]),  # 2.5 -> 3
    (10, 0.15, 2, [2, 4, 6, 8, 10]),  # 1.5 -> 2
    (7, 0.3, 3, [3, 6]),  # 2.1 -> 3
    (25, 0.28, 8, [8, 16, 24]),  # 25 * 0.28 == 7.000000000000001 in floating point -> 8, as HF computes it
    (9, 0.5, 5, [5]),  # 4.5 -> 5
]


@pytest.mark.parametrize("max_steps, ratio, every, multiples", CASES)
def test_hf_computes_the_same_interval(max_steps, ratio, every, multiples):
    """The hand-written table agrees with HF's own TrainerState.compute_steps."""
    pytest.importorskip("transformers")
    from transformers.trainer_callback import TrainerState

    state = TrainerState()
    state.compute_steps(SimpleNamespace(logging_steps=ratio, eval_steps=ratio, save_steps=ratio), max_steps)
    assert state.logging_steps == state.eval_steps == state.save_steps == every
    assert multiples == list(range(every, max_steps + 1, every))


@pytest.mark.parametrize("max_steps, ratio, every, multiples", CASES)
def test_fractional_log_eval_save_steps(tmp_path, max_steps, ratio, every, multiples):
    cfg = base_config(
        tmp_path,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=ratio,
        eval_strategy="steps",
        eval_steps=ratio,
        save_strategy="steps",
        save_steps=ratio,
    )
    cfg["log"] = {**cfg["log"], "steps": ratio}
    trainer = Trainer(TinyRegressor(), cfg, train_dataset=regression_data(32), eval_dataset=regression_data(4, seed=1))
    trainer.fit()
    history = trainer.state.log_history
    assert (trainer.state.logging_steps, trainer.state.eval_steps, trainer.state.save_steps) == (every, every, every)
    assert [h["step"] for h in history if "loss" in h] == multiples
    # evaluations at the multiples (HF 5 adds one at a final step that is not a multiple: issue 15)
    assert [h["step"] for h in history if "eval_loss" in h and h["step"] < max_steps] == [
        m for m in multiples if m < max_steps
    ]
    saved = sorted(int(n.split("-")[1]) for n in os.listdir(cfg["output_dir"]) if n.startswith("checkpoint-"))
    assert saved == sorted(set(multiples) | {max_steps})  # and at the end, whatever the interval (HF)


def test_ratio_of_steps_derived_from_epochs(tmp_path):
    """The ratio applies to the max_steps that num_train_epochs gives: 2 epochs x 8 batches = 16 steps,
    0.3 * 16 = 4.8 -> every 5 steps."""
    cfg = base_config(
        tmp_path,
        max_steps=-1,
        num_train_epochs=2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        eval_strategy="steps",
        eval_steps=0.3,
    )
    cfg["log"] = {**cfg["log"], "steps": 0.3}
    trainer = Trainer(TinyRegressor(), cfg, train_dataset=regression_data(32), eval_dataset=regression_data(4, seed=1))
    trainer.fit()
    assert trainer.state.max_steps == 16 and trainer.state.eval_steps == 5
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [5, 10, 15]
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h and h["step"] < 16] == [5, 10, 15]
