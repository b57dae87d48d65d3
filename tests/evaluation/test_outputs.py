"""What the evaluation loop keeps and how: ragged sequences, nested outputs, per-batch lists,
eval_accumulation_steps, batch_eval_metrics, inputs for metrics, logits preprocessing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln import EvalPrediction, KilnError, Trainer, TrainingModule
from kiln.engine.evaluation.accumulator import EvalAccumulator
from kiln.engine.loop import evaluation as evaluation_loop
from tests.evaluation.common import accuracy, accuracy_score, config, digits, hand_logits, make_model

LENGTHS = [1 + (3 * i) % 7 for i in range(10)]  # sequence lengths 1..7, in no particular order


class Ragged(torch.utils.data.Dataset):
    """Item i is the sequence [i, i, ..., i] of length LENGTHS[i]."""

    def __len__(self) -> int:
        return len(LENGTHS)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"ids": torch.full((LENGTHS[i],), i), "index": torch.tensor(i)}


def pad_collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pads each batch to its own longest sequence (with 0): batches differ in length."""
    width = max(len(it["ids"]) for it in items)
    ids = torch.stack([F.pad(it["ids"], (0, width - len(it["ids"])), value=0) for it in items])
    return {"ids": ids, "index": torch.stack([it["index"] for it in items])}


class SeqModule(TrainingModule):
    """Per-token 'logits' (ids * 10), a nested tuple/dict of outputs, per-token labels (the ids)."""

    nested = False

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(10.0))

    def training_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.scale * 0

    def validation_step(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        logits = batch["ids"].float() * self.scale
        if self.nested:
            logits = (logits, {"index": batch["index"] * 2, "pair": batch["ids"][:, :1].repeat(1, 2)})
        return {"loss": self.scale * 0 + batch["index"].float().mean(), "logits": logits, "labels": batch["ids"]}


def expected_rows(batch_size: int, pad: int) -> np.ndarray:
    """Each batch right-padded with 0 to its own width, then every batch with `pad` to the global width."""
    width = max(LENGTHS)
    out = np.full((len(LENGTHS), width), pad, dtype=np.int64)
    for start in range(0, len(LENGTHS), batch_size):
        rows = range(start, min(start + batch_size, len(LENGTHS)))
        batch_width = max(LENGTHS[i] for i in rows)
        for i in rows:
            out[i, :batch_width] = 0
            out[i, : LENGTHS[i]] = i
    return out


@pytest.mark.parametrize("pad", [-100, -1])
def test_sequences_of_different_lengths_are_right_padded(tmp_path: Any, pad: int) -> None:
    cfg = config(tmp_path, per_device_eval_batch_size=3, eval={"padding_index": pad})
    seen: list[EvalPrediction] = []
    trainer = Trainer(SeqModule(), cfg, data_collator=pad_collate, compute_metrics=lambda p: seen.append(p) or {})
    out = trainer.predict(Ragged())
    expected = expected_rows(3, pad)
    np.testing.assert_array_equal(out.label_ids, expected)
    want_logits = np.where(expected == pad, pad, expected * 10.0)
    np.testing.assert_array_equal(out.predictions, want_logits)
    assert out.predictions.dtype == np.float32
    np.testing.assert_array_equal(seen[0].label_ids, expected)
    # the loss is the per-batch mean weighted by batch size: the mean index over the dataset
    assert out.metrics["test_loss"] == pytest.approx(np.mean(range(10)))


def test_nested_tuple_and_dict_outputs(tmp_path: Any) -> None:
    model = SeqModule()
    model.nested = True
    trainer = Trainer(model, config(tmp_path, per_device_eval_batch_size=4), data_collator=pad_collate)
    logits, extra = trainer.predict(Ragged()).predictions
    np.testing.assert_array_equal(logits, np.where(expected_rows(4, -100) == -100, -100, expected_rows(4, -100) * 10.0))
    assert set(extra) == {"index", "pair"}
    np.testing.assert_array_equal(extra["index"], np.arange(10) * 2)
    np.testing.assert_array_equal(extra["pair"], np.repeat(np.arange(10)[:, None], 2, axis=1))


def test_do_concat_batches_false_keeps_one_entry_per_batch(tmp_path: Any) -> None:
    seen: list[EvalPrediction] = []

    def metrics(p: EvalPrediction) -> dict[str, float]:
        seen.append(p)
        return {"batches": float(len(p.predictions))}

    cfg = config(tmp_path, per_device_eval_batch_size=4, eval_do_concat_batches=False)
    out = Trainer(SeqModule(), cfg, data_collator=pad_collate, compute_metrics=metrics).predict(Ragged())
    assert isinstance(out.predictions, list) and isinstance(out.label_ids, list)
    assert [p.shape for p in out.label_ids] == [(4, 7), (4, 6), (2, 7)]  # each batch keeps its own width
    for b, labels in enumerate(out.label_ids):
        np.testing.assert_array_equal(labels, expected_rows(4, -100)[4 * b : 4 * b + 4, : labels.shape[1]])
    assert out.metrics["test_batches"] == 3 and isinstance(seen[0].label_ids, list)
    assert out.metrics["test_loss"] == pytest.approx(np.mean(range(10)))


class RecordingAccumulator(EvalAccumulator):
    """Records, after every add(), whether each array it holds is a torch tensor or numpy."""

    log: list[list[str]] = []

    def add(self, outputs: Any) -> None:
        super().add(outputs)
        RecordingAccumulator.log.append(sorted({type(x).__module__.split(".")[0] for x in self.held}))


@pytest.mark.parametrize("steps", [None, 1, 2])
def test_eval_accumulation_steps_moves_predictions_off_the_device(tmp_path: Any, monkeypatch: Any, steps: Any) -> None:
    monkeypatch.setattr(evaluation_loop, "EvalAccumulator", RecordingAccumulator)
    RecordingAccumulator.log = []
    _, evals = digits(n_eval=100)
    model = make_model("module")
    cfg = config(tmp_path, per_device_eval_batch_size=16, eval_accumulation_steps=steps)
    out = Trainer(model, cfg, compute_metrics=accuracy).predict(evals)

    log = RecordingAccumulator.log
    assert len(log) == 7  # 100 rows in batches of 16
    if steps is None:  # HF's default: everything stays on the device until the end
        assert all(kinds == ["torch"] for kinds in log)
    else:
        for i, kinds in enumerate(log, start=1):
            assert kinds == (["numpy"] if i % steps == 0 else ["numpy", "torch"] if i > steps else ["torch"]), (
                i,
                kinds,
            )
    np.testing.assert_allclose(out.predictions, hand_logits(model, evals).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out.label_ids, evals.labels.numpy())
    assert out.metrics["test_accuracy"] == float((out.predictions.argmax(-1) == evals.labels.numpy()).mean())


def test_batch_eval_metrics(tmp_path: Any) -> None:
    _, evals = digits(n_eval=100)
    calls: list[tuple[int, bool]] = []
    totals = {"correct": 0, "seen": 0}

    def streaming_accuracy(p: EvalPrediction, compute_result: bool) -> dict[str, float]:
        assert isinstance(p.predictions, torch.Tensor) and len(p) == 2  # the batch's tensors, as in HF
        calls.append((len(p.label_ids), compute_result))
        totals["correct"] += int((p.predictions.argmax(-1) == p.label_ids).sum())
        totals["seen"] += len(p.label_ids)
        if not compute_result:
            return {}
        result = {"accuracy": totals["correct"] / totals["seen"]}
        totals.update(correct=0, seen=0)
        return result

    model = make_model("hf")
    cfg = config(tmp_path, batch_eval_metrics=True)
    trainer = Trainer(model, cfg, eval_dataset=evals, compute_metrics=streaming_accuracy)
    metrics = trainer.evaluate()
    assert calls == [(32, False), (32, False), (32, False), (4, True)]
    logits = hand_logits(model, evals)
    assert metrics["eval_accuracy"] == accuracy_score(evals.labels.numpy(), logits.argmax(-1).numpy()) > 0.8
    assert metrics["eval_loss"] == pytest.approx(F.cross_entropy(logits, evals.labels).item(), rel=1e-5)

    calls.clear()
    out = trainer.predict(evals)  # predict still returns the predictions (HF)
    assert calls[-1] == (4, True) and out.metrics["test_accuracy"] == metrics["eval_accuracy"]
    np.testing.assert_allclose(out.predictions, logits.numpy(), rtol=1e-5, atol=1e-6)


def test_include_inputs_for_metrics(tmp_path: Any) -> None:
    _, evals = digits(n_eval=50)
    seen: list[EvalPrediction] = []
    model = make_model("hf")  # main_input_name = "pixels"
    trainer = Trainer(
        model,
        config(tmp_path, include_inputs_for_metrics=True),
        eval_dataset=evals,
        compute_metrics=lambda p: seen.append(p) or {},
    )
    trainer.evaluate()
    (p,) = seen
    assert len(p) == 3  # (predictions, label_ids, inputs), as HF
    np.testing.assert_array_equal(p.inputs, evals.pixels.numpy())
    np.testing.assert_array_equal(p.label_ids, evals.labels.numpy())

    module = make_model("module")  # no main_input_name: "input_ids" is not in the batch
    with pytest.raises(KilnError, match="main_input_name"):
        Trainer(module, config(tmp_path, include_inputs_for_metrics=True), compute_metrics=accuracy).predict(evals)
    module.main_input_name = "pixels"
    trainer = Trainer(
        module, config(tmp_path, include_inputs_for_metrics=True), compute_metrics=lambda p: seen.append(p) or {}
    )
    trainer.predict(evals)
    np.testing.assert_array_equal(seen[-1].inputs, evals.pixels.numpy())


def test_preprocess_logits_for_metrics(tmp_path: Any) -> None:
    _, evals = digits(n_eval=70)
    model = make_model("module")
    calls: list[tuple[tuple[int, ...], bool]] = []

    def argmax(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        calls.append((tuple(logits.shape), labels is not None))
        return logits.argmax(-1)

    def metrics(p: EvalPrediction) -> dict[str, float]:
        assert p.predictions.shape == (70,)
        return {"accuracy": float((p.predictions == p.label_ids).mean())}

    trainer = Trainer(
        model, config(tmp_path), eval_dataset=evals, compute_metrics=metrics, preprocess_logits_for_metrics=argmax
    )
    out = trainer.evaluate()
    assert calls == [((32, 10), True), ((32, 10), True), ((6, 10), True)]
    hand = hand_logits(model, evals).argmax(-1)
    assert out["eval_accuracy"] == accuracy_score(evals.labels.numpy(), hand.numpy()) > 0.8
    np.testing.assert_array_equal(trainer.predict(evals).predictions, hand.numpy())
