"""HF's evaluation override points on a Trainer subclass: `prediction_step`, `evaluation_loop` and
`get_eval_dataloader` are called by evaluate, predict and the evaluations during fit(), with HF's
signatures, and what they return is what the caller reports."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kiln import Trainer
from tests.evaluation.common import DigitsModule, accuracy, config, digits, eval_logs, hand_logits, make_model


class Negated(Trainer):
    """prediction_step with HF's signature: the default step's logits, negated (so argmax picks the worst)."""

    calls = 0

    def prediction_step(
        self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[Any, Any, Any]:
        Negated.calls += 1
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        return loss, (None if logits is None else -logits), labels


@pytest.mark.parametrize("kind", ["module", "hf"])
def test_a_prediction_step_override_is_used_by_evaluate_and_predict(tmp_path: Any, kind: str) -> None:
    _, evals = digits(n_eval=70)  # batches of 32, 32, 6
    model = make_model(kind)
    trainer = Negated(model, config(tmp_path), eval_dataset=evals, compute_metrics=accuracy)
    negated = (-hand_logits(model, evals)).argmax(-1).numpy()
    worst = float((negated == evals.labels.numpy()).mean())

    Negated.calls = 0
    metrics = trainer.evaluate()
    assert Negated.calls == 3
    assert metrics["eval_accuracy"] == pytest.approx(worst, abs=0) and worst < 0.2  # the override's logits

    out = trainer.predict(evals)
    assert Negated.calls == 6
    np.testing.assert_allclose(out.predictions, -hand_logits(model, evals).numpy(), rtol=1e-5, atol=1e-6)
    assert out.metrics["test_accuracy"] == pytest.approx(worst, abs=0)


class Described(Trainer):
    """evaluation_loop with HF's signature: records each call and adds a metric to what the default returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loops: list[tuple[str, str, int, Any]] = []

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> Any:
        self.loops.append((description, metric_key_prefix, self.state.global_step, ignore_keys))
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        output.metrics[f"{metric_key_prefix}_marked"] = 1.0
        return output


def test_an_evaluation_loop_override_is_used_by_evaluate_predict_and_fit(tmp_path: Any) -> None:
    """...with fit()'s ignore_keys_for_eval at every evaluation during training."""
    train, evals = digits(n_train=32, n_eval=40)
    cfg = config(tmp_path, per_device_train_batch_size=8, max_steps=4, eval_strategy="steps", eval_steps=2)
    trainer = Described(make_model("hf"), cfg, train_dataset=train, eval_dataset=evals)
    trainer.fit(ignore_keys_for_eval=["hidden"])  # handed to every evaluation during the fit
    assert trainer.loops == [("Evaluation", "eval", 2, ["hidden"]), ("Evaluation", "eval", 4, ["hidden"])]
    assert [entry["eval_marked"] for entry in eval_logs(trainer)] == [1.0, 1.0]  # what the override returned

    trainer.loops.clear()
    assert trainer.evaluate(metric_key_prefix="val")["val_marked"] == 1.0
    assert trainer.predict(evals).metrics["test_marked"] == 1.0
    assert trainer.loops == [("Evaluation", "val", 4, None), ("Prediction", "test", 4, None)]


def test_a_get_eval_dataloader_override_serves_evaluation_during_fit(tmp_path: Any) -> None:
    """No eval_dataset: the override finds its own data, so fit() does not refuse eval_strategy."""
    train, evals = digits(n_train=32, n_eval=40)

    class OwnLoader(Trainer):
        def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
            return torch.utils.data.DataLoader(evals, batch_size=16)

    cfg = config(tmp_path, per_device_train_batch_size=8, max_steps=2, eval_strategy="steps", eval_steps=2)
    trainer = OwnLoader(make_model("hf"), cfg, train_dataset=train)
    trainer.fit()
    [logged] = eval_logs(trainer)
    assert logged["step"] == 2 and np.isfinite(logged["eval_loss"])
    with pytest.raises(Exception, match="no eval_dataset"):
        Trainer(make_model("hf"), cfg, train_dataset=train).fit()


def test_labels_a_validation_step_returns_win_over_the_batch_s(tmp_path: Any) -> None:
    """The default prediction_step takes labels from the batch only when the TrainingModule returns none."""
    _, evals = digits(n_eval=10)
    seen: list[np.ndarray] = []

    def metrics(p: Any) -> dict[str, float]:
        seen.append(np.asarray(p.label_ids))
        return {}

    class Shifted(DigitsModule):
        def validation_step(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            out = super().validation_step(batch)
            return {**out, "labels": out["labels"] + 1}

    Trainer(Shifted(), config(tmp_path), compute_metrics=metrics).evaluate(evals)
    np.testing.assert_array_equal(seen[0], evals.labels.numpy() + 1)
