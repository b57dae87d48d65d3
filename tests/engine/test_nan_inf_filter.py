"""`logging_nan_inf_filter`: the exact logged losses, checked against Hugging Face's Trainer running the
same scripted losses. HF's rule (per micro-batch): a nan/inf loss adds `tr_loss / (1 + steps since the
last log)` to the running sum instead of itself, where `tr_loss` is the sum so far in the logging
window. The losses are scripted values that do not depend on the weights (the gradient is zero), so
both trainers see the same numbers whatever they do to the model."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from kiln import Trainer
from tests.helpers import base_config

NAN, INF = float("nan"), float("inf")


class Scripted(nn.Module):
    """HF contract: returns the next scripted value as the loss (x * 0 keeps a graph, with zero gradient)."""

    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.values, self.calls = values, 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        value = self.values[self.calls]
        self.calls += 1
        return {"loss": (x * self.w).sum() * 0 + value}


def data(n: int) -> list[dict[str, torch.Tensor]]:
    return [{"x": torch.ones(1), "labels": torch.zeros(1)} for _ in range(n)]


def hand_rule(values: list[float], accum: int, log_every: int) -> list[float]:
    """HF's rule written out: each micro-batch adds loss / accum, a non-finite one adds the
    running sum / (1 + steps since the last log) instead; a log divides by the steps it covers."""
    logged, tr_loss, step, last = [], 0.0, 0, 0
    for i, v in enumerate(values):
        part = v / accum
        tr_loss += tr_loss / (1 + step - last) if not math.isfinite(part) else part
        if (i + 1) % accum == 0:
            step += 1
            if step % log_every == 0:
                logged.append(tr_loss / (step - last))
                tr_loss, last = 0.0, step
    return logged


def run_kiln(tmp_path, values: list[float], accum: int, log_every: int, steps: int, flt: bool = True) -> list[float]:
    cfg = base_config(
        tmp_path,
        max_steps=steps,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=accum,
        learning_rate=0.0,
        max_grad_norm=0.0,
        logging_nan_inf_filter=flt,
    )
    cfg["log"] = {**cfg["log"], "steps": log_every}
    trainer = Trainer(Scripted(values), cfg, train_dataset=data(len(values)))
    trainer.fit()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def run_hf(tmp_path, values: list[float], accum: int, log_every: int, steps: int) -> list[float]:
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=steps,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=accum,
        learning_rate=0.0,
        max_grad_norm=0.0,
        logging_steps=log_every,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    trainer = transformers.Trainer(model=Scripted(values), args=args, train_dataset=data(len(values)))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


# per micro-batch values; log every 4 steps
CASES = {
    "nan-mid-window": ([1.0, 2.0, NAN, 4.0, 5.0, 6.0, 7.0, 8.0], 1),
    "inf-first-step-of-window": ([1.0, 2.0, 3.0, 4.0, INF, 6.0, 7.0, 8.0], 1),  # nothing summed yet: adds 0
    "nan-last-step-of-window": ([1.0, 2.0, 3.0, NAN, 5.0, 6.0, 7.0, 8.0], 1),
    "two-nans": ([1.0, NAN, 3.0, -INF, 5.0, 6.0, NAN, 8.0], 1),
    # accumulation 2: HF applies the rule per micro-batch, so the finite half of a window still counts,
    # and a nan second half sees the first half already in the running sum
    "accum-nan-second-micro": ([1.0, 3.0, 2.0, 4.0, 5.0, NAN, 7.0, 9.0] + [2.0] * 8, 2),
    "accum-nan-first-micro": ([1.0, 3.0, 2.0, 4.0, NAN, 5.0, 7.0, 9.0] + [2.0] * 8, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logged_loss_follows_hfs_rule(tmp_path, case):
    values, accum = CASES[case]
    steps = len(values) // accum
    expected = hand_rule(values, accum, log_every=4)
    assert all(math.isfinite(v) for v in expected) and len(expected) == steps // 4
    assert run_kiln(tmp_path, values, accum, 4, steps) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("case", ["nan-mid-window", "two-nans", "accum-nan-second-micro", "accum-nan-first-micro"])
def test_the_hand_rule_is_hfs(tmp_path, case):
    """The hand-written rule above agrees with HF's Trainer itself."""
    values, accum = CASES[case]
    steps = len(values) // accum
    assert run_hf(tmp_path, values, accum, 4, steps) == pytest.approx(hand_rule(values, accum, 4), rel=1e-6)


def test_without_the_filter_the_nan_is_logged(tmp_path):
    values, _ = CASES["nan-mid-window"]
    logged = run_kiln(tmp_path, values, 1, 4, 8, flt=False)
    assert math.isnan(logged[0]) and logged[1] == pytest.approx(6.5)


def test_train_loss_uses_the_filtered_values(tmp_path: Any):
    """train_loss (the mean over every step) is built from the same filtered sums as the logs."""
    values, _ = CASES["two-nans"]
    cfg = base_config(tmp_path, max_steps=8, per_device_train_batch_size=1, learning_rate=0.0, max_grad_norm=0.0)
    cfg["log"] = {**cfg["log"], "steps": 4}
    trainer = Trainer(Scripted(values), cfg, train_dataset=data(8))
    out = trainer.fit()
    assert out.training_loss == pytest.approx(sum(hand_rule(values, 1, 4)) * 4 / 8, rel=1e-6)


# -- evaluation: HF drops non-finite per-sample losses from eval_loss under the same flag ----------
def eval_loss(tmp_path, values: list[float], flt: bool, hf: bool = False) -> float:
    """eval_loss over 6 samples in batches of 2; `values` are the 3 batch losses."""
    if hf:
        transformers = pytest.importorskip("transformers")
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "hf"),
            per_device_eval_batch_size=2,
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            logging_nan_inf_filter=flt,
            dataloader_pin_memory=False,
        )
        return transformers.Trainer(model=Scripted(values), args=args).evaluate(data(6))["eval_loss"]
    cfg = base_config(tmp_path, per_device_eval_batch_size=2, logging_nan_inf_filter=flt)
    return Trainer(Scripted(values), cfg).evaluate(data(6))["eval_loss"]


@pytest.mark.parametrize("hf", [False, True], ids=["kiln", "hf"])
def test_eval_loss_drops_non_finite_batches(tmp_path, hf):
    assert eval_loss(tmp_path, [1.0, NAN, 4.0], flt=True, hf=hf) == pytest.approx(2.5)
    assert eval_loss(tmp_path, [1.0, INF, 4.0], flt=True, hf=hf) == pytest.approx(2.5)
    assert math.isnan(eval_loss(tmp_path, [1.0, NAN, 4.0], flt=False, hf=hf))
    assert math.isnan(eval_loss(tmp_path, [NAN, NAN, NAN], flt=True, hf=hf))  # nothing finite: nothing to keep
