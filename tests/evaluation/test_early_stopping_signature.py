"""`EarlyStoppingCallback.check_metric_value` has HF's signature `(args, state, control, metric_value)`:
a subclass written for HF's callback, overriding it and calling `super()`, runs unchanged on kiln and
sees the same calls as on transformers.Trainer. An override with kiln's earlier three-parameter
signature is still called that way."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln import EarlyStoppingCallback, Trainer
from kiln.engine.callbacks.state import TrainerControl
from tests.helpers import regression_data

transformers = pytest.importorskip("transformers")

SCORES = [0.5, 0.75, 0.8, 0.79, 0.78, 0.9, 0.95, 0.95]  # +0.05 is no improvement with threshold 0.1: stops early
SETTINGS = dict(
    max_steps=8,
    per_device_train_batch_size=8,
    learning_rate=1e-2,
    eval_strategy="steps",
    eval_steps=1,
    metric_for_best_model="score",
    greater_is_better=True,
    save_strategy="no",
    seed=0,
)


class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x, labels=None):
        return {"loss": F.mse_loss(self.lin(x).squeeze(-1), labels), "logits": self.lin(x)}


def _rows(n: int) -> list[dict[str, torch.Tensor]]:
    return [{"x": d["x"], "labels": d["y"]} for d in regression_data(n)]


def _scores():
    it = iter(SCORES)
    return lambda prediction: {"score": next(it)}


class _Recording:
    """HF users' pattern: override check_metric_value, look at control, defer to the parent."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.calls: list[tuple[int, float, bool]] = []

    def check_metric_value(self, args, state, control, metric_value):
        self.calls.append((state.global_step, float(metric_value), control.should_training_stop))
        super().check_metric_value(args, state, control, metric_value)


class HFRecording(_Recording, transformers.EarlyStoppingCallback):
    pass


class KilnRecording(_Recording, EarlyStoppingCallback):
    pass


def test_an_hf_style_override_runs_unchanged_and_sees_what_it_sees_on_hf(tmp_path):
    torch.manual_seed(0)
    model = Lin()
    hf_cb = HFRecording(early_stopping_patience=2, early_stopping_threshold=0.1)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), use_cpu=True, report_to=[], disable_tqdm=True, **SETTINGS
    )
    hf = transformers.Trainer(
        model=copy.deepcopy(model),
        args=args,
        train_dataset=_rows(64),
        eval_dataset=_rows(8),
        compute_metrics=_scores(),
        callbacks=[hf_cb],
    )
    hf.train()

    ours_cb = KilnRecording(early_stopping_patience=2, early_stopping_threshold=0.1)
    cfg = {
        "output_dir": str(tmp_path / "kiln"),
        "strategy": {"device": "cpu"},
        "log": {"history": [], "disable_tqdm": True},
        **SETTINGS,
    }
    ours = Trainer(
        copy.deepcopy(model),
        cfg,
        train_dataset=_rows(64),
        eval_dataset=_rows(8),
        compute_metrics=_scores(),
        callbacks=[ours_cb],
    )
    ours.fit()

    assert ours_cb.calls == hf_cb.calls
    assert ours.state.global_step == hf.state.global_step < SETTINGS["max_steps"]  # it did stop early
    assert ours_cb.early_stopping_patience_counter == hf_cb.early_stopping_patience_counter == 2


def test_the_control_is_passed_and_kiln_s_earlier_signature_still_works():
    class Sees(EarlyStoppingCallback):
        def check_metric_value(self, config, state, control, metric_value):
            self.seen = control
            super().check_metric_value(config, state, control, metric_value)

    class Old(EarlyStoppingCallback):  # kiln's signature before HF's
        def check_metric_value(self, config, state, metric_value):
            self.seen = metric_value
            super().check_metric_value(config, state, TrainerControl(), metric_value)

    from omegaconf import OmegaConf

    from kiln.engine.callbacks.state import TrainerState

    cfg = OmegaConf.create({"eval": {"metric_for_best_model": "loss", "greater_is_better": None}})
    control = TrainerControl()
    sees, old = Sees(1), Old(1)
    sees.on_evaluate(cfg, TrainerState(best_metric=1.0), control, metrics={"eval_loss": 2.0})
    old.on_evaluate(cfg, TrainerState(best_metric=1.0), control, metrics={"eval_loss": 3.0})
    assert sees.seen is control and old.seen == 3.0
    assert sees.early_stopping_patience_counter == old.early_stopping_patience_counter == 1
    assert control.should_training_stop
