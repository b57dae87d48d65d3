"""`jit_mode_eval` (`eval.compile`): evaluation runs the model through torch.compile, says so in one
INFO line, and gives the metrics of an uncompiled evaluation; training does not go through it.

torch.compile is spied on: the spy hands kiln's call to the real torch.compile with a recording
backend, so the test sees the evaluation forward traced by dynamo (and pays no inductor compile)."""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kiln import Trainer
from tests.helpers import TinyRegressor, base_config, regression_data


class HFStyle(nn.Module):
    """An HF-contract model: forward(**batch) returns loss and logits."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x, y=None):
        pred = self.net(x).squeeze(-1)
        return {"loss": F.mse_loss(pred, y), "logits": pred} if y is not None else {"logits": pred}


def _mae(pred):
    return {"mae": float(np.abs(pred.predictions - pred.label_ids).mean())}


def _spy(monkeypatch):
    """Record kiln's torch.compile calls and the graphs dynamo traces for them."""
    calls, graphs = [], []
    real = torch.compile

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def compile_spy(model, **kwargs):
        calls.append((type(model).__name__, kwargs))
        return real(model, backend=backend)

    monkeypatch.setattr(torch, "compile", compile_spy)
    return calls, graphs


def _evaluate(tmp_path, model, compiled: bool, **extra):
    torch.manual_seed(0)
    cfg = base_config(tmp_path, per_device_eval_batch_size=16, jit_mode_eval=compiled, label_names=["y"], **extra)
    trainer = Trainer(model, cfg, eval_dataset=regression_data(n=40, seed=1), compute_metrics=_mae)
    return trainer, trainer.evaluate()


def test_evaluation_runs_compiled_with_the_same_metrics(tmp_path, monkeypatch, caplog):
    for make in (TinyRegressor, HFStyle):
        torch.manual_seed(0)
        model = make()
        _, plain = _evaluate(tmp_path / make.__name__, model, compiled=False)
        calls, graphs = _spy(monkeypatch)
        with caplog.at_level(logging.INFO, logger="kiln"):
            trainer, compiled = _evaluate(tmp_path / make.__name__, model, compiled=True)
            trainer.evaluate()  # a second evaluation reuses the compiled module
        assert len(calls) == 1 and calls[0][1]["backend"] == "inductor"  # torch_compile_backend's default
        assert graphs, "the evaluation forward did not go through torch.compile"
        assert set(compiled) == set(plain)
        for key in ("eval_loss", "eval_mae"):
            assert np.isclose(compiled[key], plain[key], rtol=1e-5, atol=1e-7), (make.__name__, key)
        assert caplog.text.count("evaluation runs the model compiled with torch.compile") == 1
        monkeypatch.undo()
        caplog.clear()


def test_training_is_not_compiled(tmp_path, monkeypatch):
    calls, graphs = _spy(monkeypatch)
    torch.manual_seed(0)
    cfg = base_config(tmp_path, max_steps=2, per_device_train_batch_size=8, jit_mode_eval=True, label_names=["y"])
    trainer = Trainer(TinyRegressor(), cfg, train_dataset=regression_data(n=16))
    trainer.fit()
    assert calls == [] and graphs == []
