"""fp16_full_eval / bf16_full_eval (precision.full_eval): outside training, the model is cast for the
evaluation only and its original weights are back, bit for bit, afterwards; inside fit() it is not cast."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln.accelerators.cpu
import kiln.precision.base
from kiln import Trainer
from tests.evaluation.common import DigitsModule, accuracy, config, digits, hand_logits, make_model


class DtypeProbe(DigitsModule):
    """Records the dtype of its weights and of the input features at every validation step."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.zeros(64))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def validation_step(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.seen.append((self.net[0].weight.dtype, batch["pixels"].dtype))
        self.calls += 1
        return super().validation_step({**batch, "pixels": batch["pixels"] + self.offset})


def probe() -> DtypeProbe:
    model = DtypeProbe()
    model.net.load_state_dict(make_model("module").net.state_dict())
    return model


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("flag, dtype", [("bf16_full_eval", torch.bfloat16), ("fp16_full_eval", torch.float16)])
def test_cast_for_evaluation_only_and_restored(tmp_path: Any, monkeypatch: Any, flag: str, dtype: torch.dtype) -> None:
    monkeypatch.setattr(kiln.accelerators.cpu, "cpu_supports_fp16", lambda: True)  # fp16 kernels exist, if slow
    _, evals = digits(n_eval=64)
    model = probe()
    before = snapshot(model)
    trainer = Trainer(model, config(tmp_path, **{flag: True}), eval_dataset=evals, compute_metrics=accuracy)
    metrics = trainer.evaluate()
    assert model.seen and set(model.seen) == {(dtype, dtype)}  # weights and float inputs in the eval dtype
    after = snapshot(model)
    assert {k: v.dtype for k, v in after.items()} == {k: v.dtype for k, v in before.items()}
    assert all(torch.equal(before[k], after[k]) for k in before if k != "calls")  # bit for bit
    assert int(model.calls) == 2  # buffers updated during eval keep their update

    logits = hand_logits(model, evals)
    assert metrics["eval_loss"] == pytest.approx(F.cross_entropy(logits, evals.labels).item(), rel=0.05)
    out = trainer.predict(evals)
    assert out.predictions.dtype == (np.float16 if dtype == torch.float16 else np.float32)  # bf16 has no numpy dtype
    np.testing.assert_allclose(out.predictions, logits.numpy(), atol=0.1)


def test_not_cast_during_training(tmp_path: Any) -> None:
    train, evals = digits(n_train=32, n_eval=32)
    model = probe()
    cfg = config(
        tmp_path, bf16_full_eval=True, max_steps=2, per_device_train_batch_size=16, eval_strategy="steps", eval_steps=1
    )
    trainer = Trainer(model, cfg, train_dataset=train, eval_dataset=evals)
    trainer.fit()
    assert set(model.seen) == {(torch.float32, torch.float32)}  # HF: full-eval casting only outside train()
    model.seen.clear()
    trainer.evaluate()
    assert set(model.seen) == {(torch.bfloat16, torch.bfloat16)}
    assert model.net[0].weight.dtype == torch.float32


def test_without_full_eval_nothing_is_cast(tmp_path: Any) -> None:
    _, evals = digits(n_eval=32)
    model = probe()
    Trainer(model, config(tmp_path), eval_dataset=evals).evaluate()
    assert set(model.seen) == {(torch.float32, torch.float32)}
