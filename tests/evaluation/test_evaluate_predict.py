"""evaluate() / predict() on the digits data, checked against a hand computation with the same model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln import EvalPrediction, KilnError, PredictionOutput, Trainer
from tests.evaluation.common import (
    Recorder,
    accuracy,
    accuracy_score,
    config,
    digits,
    eval_logs,
    hand_logits,
    make_model,
)


@pytest.mark.parametrize("kind", ["module", "hf"])
def test_metrics_match_a_hand_computation(tmp_path: Any, kind: str) -> None:
    _, evals = digits(n_eval=100)
    model = make_model(kind)
    recorder = Recorder()
    trainer = Trainer(model, config(tmp_path), eval_dataset=evals, compute_metrics=accuracy, callbacks=[recorder])
    metrics = trainer.evaluate()

    logits = hand_logits(model, evals)
    by_hand = accuracy_score(evals.labels.numpy(), logits.argmax(-1).numpy())
    assert metrics["eval_accuracy"] == pytest.approx(by_hand, abs=0)
    mean_loss = F.cross_entropy(logits.double(), evals.labels, reduction="none").mean().item()
    assert metrics["eval_loss"] == pytest.approx(mean_loss, rel=1e-6)
    assert {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second"} <= set(metrics)
    assert metrics["eval_samples_per_second"] == pytest.approx(100 / metrics["eval_runtime"], rel=0.05, abs=1)
    assert metrics["epoch"] == trainer.state.epoch == 0.0  # returned, as HF's log() adds it in place
    assert all(isinstance(v, float) for k, v in metrics.items()), metrics
    # logged once, and handed to callbacks
    assert eval_logs(trainer) == [{**metrics, "step": 0}]
    assert recorder.evaluations == [(0, metrics)]


@pytest.mark.parametrize("kind", ["module", "hf"])
def test_predict_returns_numpy_in_dataset_order(tmp_path: Any, kind: str) -> None:
    _, evals = digits(n_eval=70)  # 3 batches of 32, 32, 6
    model = make_model(kind)
    recorder = Recorder()
    trainer = Trainer(model, config(tmp_path), compute_metrics=accuracy, callbacks=[recorder])
    out = trainer.predict(evals)

    assert isinstance(out, PredictionOutput)
    assert isinstance(out.predictions, np.ndarray) and isinstance(out.label_ids, np.ndarray)
    np.testing.assert_allclose(out.predictions, hand_logits(model, evals).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out.label_ids, evals.labels.numpy())
    by_hand = accuracy_score(evals.labels.numpy(), out.predictions.argmax(-1))
    assert out.metrics["test_accuracy"] == by_hand
    assert {"test_loss", "test_runtime", "test_samples_per_second", "test_steps_per_second"} <= set(out.metrics)
    assert "epoch" not in out.metrics and not eval_logs(trainer, "test_loss")  # predict does not log
    assert recorder.predictions == [out.metrics]


def test_predict_without_labels(tmp_path: Any) -> None:
    _, evals = digits(n_eval=40)
    model = make_model("hf")
    unlabeled = [{"pixels": evals.pixels[i]} for i in range(len(evals))]
    out = Trainer(model, config(tmp_path), compute_metrics=accuracy).predict(unlabeled)
    assert out.label_ids is None
    np.testing.assert_allclose(out.predictions, hand_logits(model, evals).numpy(), rtol=1e-5, atol=1e-6)
    assert "test_loss" not in out.metrics and "test_accuracy" not in out.metrics
    assert out.metrics["test_samples_per_second"] > 0


def test_metric_key_prefix_and_compute_metrics_values(tmp_path: Any) -> None:
    _, evals = digits(n_eval=40)

    def metrics(p: EvalPrediction) -> dict[str, Any]:
        assert isinstance(p.predictions, np.ndarray) and len(p) == 2
        return {
            "n": np.int64(len(p.label_ids)),
            "mean_label": np.float32(p.label_ids.mean()),
            "val_x": torch.tensor(2.5),
        }

    trainer = Trainer(make_model("module"), config(tmp_path), eval_dataset=evals, compute_metrics=metrics)
    out = trainer.evaluate(metric_key_prefix="val")
    assert out["val_n"] == 40 and type(out["val_n"]) is int
    assert out["val_mean_label"] == pytest.approx(evals.labels.float().mean().item())
    assert out["val_x"] == 2.5  # an already-prefixed key is not prefixed twice
    assert "val_loss" in out and "val_runtime" in out


def test_dict_of_eval_datasets(tmp_path: Any) -> None:
    _, evals = digits(n_eval=100)
    a = torch.utils.data.Subset(evals, range(0, 40))
    b = torch.utils.data.Subset(evals, range(40, 100))
    model = make_model("module")
    recorder = Recorder()
    trainer = Trainer(
        model, config(tmp_path), eval_dataset={"a": a, "b": b}, compute_metrics=accuracy, callbacks=[recorder]
    )
    metrics = trainer.evaluate()

    logits = hand_logits(model, evals)
    for name, rows in (("a", slice(0, 40)), ("b", slice(40, 100))):
        labels = evals.labels[rows]
        assert metrics[f"eval_{name}_accuracy"] == accuracy_score(labels.numpy(), logits[rows].argmax(-1).numpy())
        assert metrics[f"eval_{name}_loss"] == pytest.approx(F.cross_entropy(logits[rows], labels).item(), rel=1e-5)
        assert f"eval_{name}_runtime" in metrics and f"eval_{name}_steps_per_second" in metrics
    assert "eval_loss" not in metrics
    # one evaluation (log entry, on_evaluate call) per dataset
    assert [sorted(k for k in m if k.endswith("_loss")) for _, m in recorder.evaluations] == [
        ["eval_a_loss"],
        ["eval_b_loss"],
    ]
    assert len(eval_logs(trainer, "eval_a_loss")) == len(eval_logs(trainer, "eval_b_loss")) == 1
    # one of them by name, and a dict passed to evaluate() itself
    by_name = trainer.evaluate("b")  # HF: a single dataset picked by name keeps the plain prefix
    assert by_name["eval_loss"] == metrics["eval_b_loss"] and "eval_a_loss" not in by_name
    again = trainer.evaluate({"x": a})
    assert again["eval_x_loss"] == metrics["eval_a_loss"]
    with pytest.raises(KilnError, match="named 'c'"):
        trainer.evaluate("c")


def test_no_eval_dataset_is_a_clear_error(tmp_path: Any) -> None:
    with pytest.raises(KilnError, match="eval_dataset"):
        Trainer(make_model("module"), config(tmp_path)).evaluate()


def test_per_device_eval_batch_size_and_drop_last(tmp_path: Any) -> None:
    _, evals = digits(n_eval=100)
    sizes: list[int] = []
    model = make_model("module")
    original = model.validation_step

    def recording(batch: Any) -> Any:
        sizes.append(len(batch["labels"]))
        return original(batch)

    model.validation_step = recording  # type: ignore[method-assign]
    trainer = Trainer(model, config(tmp_path, per_device_eval_batch_size=24), compute_metrics=accuracy)
    out = trainer.predict(evals)
    assert sizes == [24, 24, 24, 24, 4] and out.predictions.shape == (100, 10)

    sizes.clear()
    trainer = Trainer(model, config(tmp_path, eval_batch_size=32, dataloader_drop_last=True), compute_metrics=accuracy)
    out = trainer.predict(evals)
    assert sizes == [32, 32, 32]
    assert out.predictions.shape == (96, 10) and out.label_ids.tolist() == evals.labels[:96].tolist()
    logits = hand_logits(model, evals)[:96]
    assert out.metrics["test_loss"] == pytest.approx(F.cross_entropy(logits, evals.labels[:96]).item(), rel=1e-5)
    assert out.metrics["test_samples_per_second"] == pytest.approx(96 / out.metrics["test_runtime"], rel=0.05, abs=1)


def test_prediction_loss_only(tmp_path: Any) -> None:
    _, evals = digits(n_eval=40)
    called = []
    trainer = Trainer(
        make_model("hf"),
        config(tmp_path, prediction_loss_only=True),
        eval_dataset=evals,
        compute_metrics=lambda p: called.append(p) or {"x": 1.0},
    )
    out = trainer.predict(evals)
    assert out.predictions is None and out.label_ids is None
    assert "test_loss" in out.metrics and "test_x" not in out.metrics
    assert "eval_x" not in trainer.evaluate() and not called


def test_evaluate_without_compute_metrics_keeps_only_the_loss(tmp_path: Any) -> None:
    _, evals = digits(n_eval=40)
    model = make_model("module")
    out = Trainer(model, config(tmp_path), eval_dataset=evals).evaluate()
    assert set(out) == {"eval_loss", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch"}


class TargetModel(nn.Module):
    """An HF-contract model whose label argument is not called "labels"."""

    main_input_name = "pixels"

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(64, 10)

    def forward(self, pixels: torch.Tensor, target: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        logits = self.net(pixels)
        return (logits,) if target is None else (F.cross_entropy(logits, target), logits)


def test_label_names(tmp_path: Any) -> None:
    _, evals = digits(n_eval=40)
    rows = [{"pixels": evals.pixels[i], "target": evals.labels[i]} for i in range(len(evals))]
    model = TargetModel()
    with torch.no_grad():
        logits = model.net(evals.pixels)

    out = Trainer(model, config(tmp_path, label_names=["target"]), compute_metrics=accuracy).predict(rows)
    np.testing.assert_array_equal(out.label_ids, evals.labels.numpy())
    np.testing.assert_allclose(out.predictions, logits.numpy(), rtol=1e-5, atol=1e-6)  # tuple output minus the loss
    assert out.metrics["test_loss"] == pytest.approx(F.cross_entropy(logits, evals.labels).item(), rel=1e-5)
    assert out.metrics["test_accuracy"] == accuracy_score(evals.labels.numpy(), logits.argmax(-1).numpy())

    # without label_names, "target" is not recognised as a label: no loss, no label_ids
    out = Trainer(model, config(tmp_path), compute_metrics=accuracy).predict([{"pixels": r["pixels"]} for r in rows])
    assert out.label_ids is None and "test_loss" not in out.metrics


class MultiHead(nn.Module):
    """Returns several outputs plus one the caller ignores."""

    main_input_name = "pixels"

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(64, 10)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        logits = self.net(pixels)
        out: dict[str, Any] = {"logits": logits, "hidden": pixels[:, :3], "cache": None, "debug": pixels.sum(-1)}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def test_hf_outputs_minus_loss_minus_ignore_keys(tmp_path: Any) -> None:
    _, evals = digits(n_eval=40)
    model = MultiHead()
    model.config = type("Cfg", (), {"keys_to_ignore_at_inference": ["debug"]})()  # as Transformers configs carry
    trainer = Trainer(model, config(tmp_path))
    out = trainer.predict(evals)
    logits, hidden = out.predictions  # None values dropped, "debug" ignored by default, "loss" never a prediction
    assert logits.shape == (40, 10) and np.array_equal(hidden, evals.pixels[:, :3].numpy())
    out = trainer.predict(evals, ignore_keys=["hidden"])
    assert [p.shape for p in out.predictions] == [(40, 10), (40,)]  # explicit ignore_keys replace the default


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset (no length): the loop counts the samples it sees."""

    def __init__(self, rows: Any) -> None:
        self.rows = rows

    def __iter__(self) -> Any:
        return iter(self.rows[i] for i in range(len(self.rows)))


def test_iterable_dataset(tmp_path: Any) -> None:
    _, evals = digits(n_eval=70)
    model = make_model("hf")
    out = Trainer(model, config(tmp_path), compute_metrics=accuracy).predict(Stream(evals))
    np.testing.assert_allclose(out.predictions, hand_logits(model, evals).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out.label_ids, evals.labels.numpy())
    assert out.metrics["test_samples_per_second"] == pytest.approx(70 / out.metrics["test_runtime"], rel=0.05, abs=1)
