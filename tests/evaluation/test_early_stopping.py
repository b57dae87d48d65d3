"""EarlyStoppingCallback: stops at exactly the right step, honours the threshold and direction, and
its patience counter survives a resume."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

import kiln
from kiln import Callback, EarlyStoppingCallback, KilnError, Trainer
from tests.evaluation.common import config, digits, eval_logs, make_model


def run(
    tmp_path: Any,
    callback: EarlyStoppingCallback,
    compute_metrics: Any = None,
    resume: Any = None,
    extra: list[Callback] | None = None,
    **overrides: Any,
) -> Trainer:
    """lr = 0: the weights never change, so eval_loss is the same at every evaluation (a plateau)."""
    train, evals = digits(n_train=64, n_eval=32)
    settings = dict(
        per_device_train_batch_size=16,
        learning_rate=0.0,
        max_steps=40,
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best_model="loss",
    )
    settings.update(overrides)
    trainer = Trainer(
        make_model("module"),
        config(tmp_path, **settings),
        train_dataset=train,
        eval_dataset=evals,
        compute_metrics=compute_metrics,
        callbacks=[callback, *(extra or [])],
    )
    trainer.fit(resume_from_checkpoint=resume)
    return trainer


def test_exported_from_kiln() -> None:
    assert kiln.EarlyStoppingCallback is EarlyStoppingCallback


@pytest.mark.parametrize("patience, stop_step", [(1, 4), (2, 6), (4, 10)])
def test_stops_after_patience_evaluations_without_improvement(tmp_path: Any, patience: int, stop_step: int) -> None:
    # evaluation 1 (step 2) sets the best; every later one fails to beat it
    trainer = run(tmp_path, EarlyStoppingCallback(early_stopping_patience=patience))
    assert trainer.state.global_step == stop_step
    assert [e["step"] for e in eval_logs(trainer)] == list(range(2, stop_step + 1, 2))
    assert trainer.state.best_global_step == 2


def test_stops_at_an_epoch_evaluation(tmp_path: Any) -> None:
    trainer = run(tmp_path, EarlyStoppingCallback(1), eval_strategy="epoch", max_steps=-1, num_train_epochs=10)
    assert trainer.state.global_step == 8 and trainer.state.epoch == 2.0  # 4 steps per epoch


def scripted(values: list[float], key: str = "score") -> Any:
    it: Iterator[float] = iter(values)
    return lambda p: {key: next(it)}


def test_threshold_and_greater_is_better(tmp_path: Any) -> None:
    # improvements of 0.05 do not count with threshold 0.1; the counter resets on the jump to 1.5
    values = [1.0, 1.05, 1.5, 1.52, 1.53, 9.0]
    cb = EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.1)
    trainer = run(tmp_path, cb, scripted(values), metric_for_best_model="score", eval_steps=1)
    assert trainer.state.global_step == 5
    assert trainer.state.best_metric == 1.53  # the best still tracks every improvement

    # a falling metric improves when greater_is_better is False
    falling = [5.0, 4.0, 3.0, 3.5, 3.2, 0.0]
    trainer = run(
        tmp_path / "b",
        EarlyStoppingCallback(2),
        scripted(falling),
        metric_for_best_model="score",
        greater_is_better=False,
        eval_steps=1,
    )
    assert trainer.state.global_step == 5 and trainer.state.best_metric == 3.0


def test_needs_a_metric_and_evaluation(tmp_path: Any) -> None:
    with pytest.raises(KilnError, match="metric_for_best_model"):
        run(tmp_path, EarlyStoppingCallback(), metric_for_best_model=None)
    with pytest.raises(KilnError, match="eval.strategy"):
        run(tmp_path / "b", EarlyStoppingCallback(), eval_strategy="no")
    with pytest.raises(ValueError, match="patience"):
        EarlyStoppingCallback(0)


def test_missing_metric_is_not_counted(tmp_path: Any, caplog: Any) -> None:
    """E.g. the other datasets of an eval dict: their evaluations lack the metric and do not count."""
    trainer = Trainer(make_model("module"), config(tmp_path, metric_for_best_model="loss"))
    cb = EarlyStoppingCallback(1)
    cb.on_evaluate(trainer.config, trainer.state, trainer.control, metrics={"eval_other_loss": 1.0})
    assert cb.early_stopping_patience_counter == 0 and not trainer.control.should_training_stop
    assert "no 'eval_loss'" in caplog.text


class Crash(Callback):
    """Kills the run (an exception) when the given step ends."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            raise RuntimeError("killed")


def test_counter_survives_resume(tmp_path: Any) -> None:
    """patience 3, plateau from the first evaluation: an uninterrupted run stops at step 8. A run
    killed at step 5 resumes from checkpoint-4 (counter 1) and must also stop at 8, not at 10."""
    settings = dict(save_strategy="steps", save_steps=2)
    reference = run(tmp_path / "ref", EarlyStoppingCallback(3), **settings)
    assert reference.state.global_step == 8

    with pytest.raises(RuntimeError, match="killed"):
        run(tmp_path / "crash", EarlyStoppingCallback(3), extra=[Crash(5)], **settings)
    out = tmp_path / "crash" / "out"
    with open(out / "checkpoint-4" / "trainer_state.json") as fh:
        saved = json.load(fh)["stateful_callbacks"]["EarlyStoppingCallback"]
    assert saved == {
        "args": {"early_stopping_patience": 3, "early_stopping_threshold": 0.0},
        "attributes": {"early_stopping_patience_counter": 1},
    }  # HF's ExportableState layout

    resumed_cb = EarlyStoppingCallback(3)
    resumed = run(tmp_path / "crash", resumed_cb, resume=True, **settings)
    assert resumed.state.global_step == 8
    assert resumed_cb.early_stopping_patience_counter == 3
    assert [e["step"] for e in eval_logs(resumed)] == [2, 4, 6, 8]
    assert os.path.isdir(out / "checkpoint-8")


@pytest.mark.parametrize(
    "values, greater, stop_step",
    [
        ([0.5, 0.75, 0.75, 0.75], True, 2),  # exactly the threshold better: not an improvement (HF's strict >)
        ([0.5, 0.25, 0.25, 0.25], False, 2),  # the same when lower is better
        ([0.5, 0.76, 0.76, 0.76], True, 3),  # beyond the threshold: an improvement, the counter resets
        ([0.5, 0.5, 0.5, 0.5], True, 2),  # equal is never better, even with threshold 0
    ],
)
def test_an_improvement_of_exactly_the_threshold_does_not_count(tmp_path: Any, values, greater, stop_step) -> None:
    threshold = 0.0 if values[1] == values[0] else 0.25
    cb = EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=threshold)
    trainer = run(
        tmp_path, cb, scripted(values), metric_for_best_model="score", greater_is_better=greater, eval_steps=1
    )
    assert trainer.state.global_step == stop_step
