"""Precision through the Trainer: bf16 learns as well as fp32 on the digits example and on a
generated task, fp16 skips an inf step without advancing the scheduler, and the scaler survives a
checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln import Callback, Trainer, TrainingModule
from tests.helpers import base_config


class Classifier(TrainingModule):
    def __init__(self, d_in: int = 16, classes: int = 4, poison_call: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(d_in, 64), nn.GELU(), nn.Linear(64, classes))
        self.poison_call, self.calls = poison_call, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch):
        self.calls += 1
        loss = F.cross_entropy(self(batch["x"]), batch["labels"])
        if self.calls == self.poison_call:
            loss = loss * float("inf")  # every gradient of this step becomes inf/nan
        return loss

    def validation_step(self, batch):
        logits = self(batch["x"])
        return {"loss": F.cross_entropy(logits, batch["labels"]), "logits": logits, "labels": batch["labels"]}


def blobs(n: int = 256, d_in: int = 16, classes: int = 4, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Gaussian clusters around random centres: a classification task an MLP learns in a few epochs."""
    g = torch.Generator().manual_seed(seed)
    centres = 2.0 * torch.randn(classes, d_in, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    x = centres[labels] + torch.randn(n, d_in, generator=g)
    return [{"x": x[i], "labels": labels[i]} for i in range(n)]


def _fit(tmp_path, name: str, model: nn.Module, train, eval_data=None, **overrides):
    cfg = base_config(
        tmp_path / name,
        precision=name,
        learning_rate=5e-3,
        per_device_train_batch_size=32,
        lr_scheduler_type="linear",
        **overrides,
    )
    trainer = Trainer(model, cfg, train_dataset=train, eval_dataset=eval_data)
    out = trainer.fit()
    return trainer, out


def test_bf16_converges_within_a_small_gap_of_fp32(tmp_path):
    everything = blobs(384)
    data, held_out = everything[:256], everything[256:]
    results = {}
    for name in ("fp32", "bf16"):
        trainer, out = _fit(tmp_path, name, Classifier(), data, held_out, num_train_epochs=4)
        results[name] = (out.training_loss, trainer.evaluate()["eval_loss"])
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    (fp32_train, fp32_eval), (bf16_train, bf16_eval) = results["fp32"], results["bf16"]
    assert fp32_eval < 0.3  # the task is learnt
    assert abs(bf16_train - fp32_train) < 0.02 and abs(bf16_eval - fp32_eval) < 0.02, results


def test_bf16_on_the_digits_example_matches_fp32(tmp_path):
    pytest.importorskip("sklearn")
    from examples.digits.data import build_data
    from examples.digits.model import MLPClassifier

    data = build_data(seed=0)
    accuracy = {}
    for name in ("fp32", "bf16"):
        torch.manual_seed(0)
        trainer, _ = _fit(
            tmp_path,
            name,
            MLPClassifier(**data["model_args"], dropout=0.0),
            data["train_dataset"],
            data["eval_dataset"],
            num_train_epochs=2,
        )
        trainer.compute_metrics = data["compute_metrics"]
        accuracy[name] = trainer.evaluate()["eval_accuracy"]
    assert accuracy["fp32"] > 0.9
    assert abs(accuracy["bf16"] - accuracy["fp32"]) <= 0.02, accuracy


class StepRecorder(Callback):
    """After every optimizer step: (skipped steps so far, scheduler steps so far, a weight)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.rows: list[tuple[int, int, torch.Tensor]] = []

    def on_step_end(self, config, state, control, **kw):
        t = self.trainer
        weight = t.model.net[0].weight.detach().clone()
        self.rows.append((t.precision.skipped_steps, t.lr_scheduler.last_epoch, weight))


def test_fp16_skips_the_inf_step_and_the_scheduler_does_not_advance(tmp_path, fp16_cpu):
    steps, poisoned = 8, 4  # the 4th micro-batch (= optimizer step) has an inf loss
    recorder = StepRecorder()
    cfg = base_config(tmp_path, precision="fp16", learning_rate=5e-3, per_device_train_batch_size=32, max_steps=steps)
    trainer = Trainer(Classifier(poison_call=poisoned), cfg, train_dataset=blobs(256), callbacks=[recorder])
    recorder.trainer = trainer
    out = trainer.fit()
    assert out.global_step == steps and len(recorder.rows) == steps

    (skipped_before, sched_before, w_before), (skipped_at, sched_at, w_at) = recorder.rows[poisoned - 2 : poisoned]
    assert skipped_at == skipped_before + 1  # counted
    assert sched_at == sched_before  # the scheduler did not advance on it
    assert torch.equal(w_at, w_before)  # and the weights did not move
    # over the whole run: one scheduler step per optimizer step that was not skipped (fp16 with the
    # default 2**16 initial scale may also skip a step of its own early on, which is the scaler working)
    total_skipped = trainer.precision.skipped_steps
    assert 1 <= total_skipped < steps
    assert trainer.lr_scheduler.last_epoch == steps - total_skipped
    assert trainer.precision.scaler.get_scale() == 2.0 ** (16 - total_skipped)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_fp16_scaler_state_is_resumed_from_a_checkpoint(tmp_path, fp16_cpu):
    overrides = {"save": {"strategy": "steps", "steps": 4}, "max_steps": 4}
    trainer, _ = _fit(tmp_path, "fp16", Classifier(poison_call=2), blobs(128), **overrides)
    saved = trainer.precision.state_dict()
    assert saved["skipped_steps"] == 1 and saved["scaler"]["scale"] == 2.0**15

    cfg = base_config(
        tmp_path / "fp16",
        precision="fp16",
        learning_rate=5e-3,
        per_device_train_batch_size=32,
        max_steps=6,
        save={"strategy": "steps", "steps": 4},
    )
    resumed = Trainer(Classifier(), cfg, train_dataset=blobs(128))
    resumed.fit(resume_from_checkpoint=True)
    assert resumed.precision.skipped_steps == 1
    assert resumed.precision.scaler.get_scale() == 2.0**15
    assert resumed.precision.scaler._get_growth_tracker() == saved["scaler"]["_growth_tracker"] + 2


def test_bf16_true_trains_through_the_trainer(tmp_path):
    everything = blobs(384)
    cfg = base_config(
        tmp_path, precision="bf16-true", learning_rate=5e-3, per_device_train_batch_size=32, num_train_epochs=4
    )
    trainer = Trainer(Classifier(), cfg, train_dataset=everything[:256], eval_dataset=everything[256:])
    trainer.fit()
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert trainer.evaluate()["eval_loss"] < 0.3  # learnt, with bf16 weights and bf16 inputs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only rejection")
def test_tf32_on_cpu_is_rejected_when_the_trainer_is_built(tmp_path):
    from kiln.precision.base import PrecisionError

    cfg = base_config(tmp_path, precision={"name": "bf16", "tf32": True})
    with pytest.raises(PrecisionError, match="TF32 only applies to NVIDIA Ampere or newer GPUs"):
        Trainer(Classifier(), cfg, train_dataset=blobs(32))
