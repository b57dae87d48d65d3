"""LOMO / AdaLomo (`optim: lomo` / `adalomo`): the optimizer owns backward (the strategy hands it the
loss), so a kiln run equals a hand-written loop of `fused_backward(loss, lr)` calls with the
scheduler's learning rate, the loss falls, and a gradient scaler or several processes are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln import Trainer
from kiln.utils.errors import ConfigError
from tests.helpers import TinyRegressor, base_config, flat_params, regression_data

lomo_optim = pytest.importorskip("lomo_optim")

STEPS, LR = 6, 5e-2


def _data():
    return regression_data(n=STEPS * 8, seed=3)


def _initial():
    torch.manual_seed(0)
    return TinyRegressor()


def _full_loss(model):
    x, y = torch.stack([d["x"] for d in _data()]), torch.stack([d["y"] for d in _data()])
    with torch.no_grad():
        return float(F.mse_loss(model(x), y))


def _kiln(tmp_path, name, **extra):
    model = _initial()
    loader = torch.utils.data.DataLoader(_data(), batch_size=8)  # used as given: the order is fixed
    cfg = base_config(
        tmp_path,
        optim=name,
        learning_rate=LR,
        max_steps=STEPS,
        warmup_steps=2,
        log={"history": [], "disable_tqdm": True, "steps": 1},
        **extra,
    )
    trainer = Trainer(model, cfg, train_dataset=loader)
    trainer.fit()
    return trainer, model


def _by_hand(name):
    model = _initial()
    cls = lomo_optim.AdaLomo if name == "adalomo" else lomo_optim.Lomo
    opt = cls(model, lr=LR)
    losses = []
    for step, batch in enumerate(torch.utils.data.DataLoader(_data(), batch_size=8)):
        lr = LR * step / 2 if step < 2 else LR * (STEPS - step) / (STEPS - 2)  # linear from 0, 2 warmup steps
        loss = F.mse_loss(model(batch["x"]), batch["y"])
        opt.fused_backward(loss, lr)
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize(
    "name",
    [
        "lomo",
        pytest.param(
            "adalomo",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="lomo-optim's AdaLomo allocates its state with .cuda()"
            ),
        ),
    ],
)
def test_training_equals_a_hand_written_loop(tmp_path, name, recwarn):
    trainer, model = _kiln(tmp_path, name)
    # the step still calls the optimizer's (no-op) step, which the scheduler's first step expects before it
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    reference, losses = _by_hand(name)
    assert type(trainer.optimizer).__name__ == ("AdaLomo" if name == "adalomo" else "Lomo")
    torch.testing.assert_close(flat_params(model), flat_params(reference))
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged == pytest.approx(losses, rel=1e-5)
    assert _full_loss(model) < 0.85 * _full_loss(_initial())
    assert [h["learning_rate"] for h in trainer.state.log_history if "loss" in h][:3] == pytest.approx([0, LR / 2, LR])


def _lomo_trainer(tmp_path):
    cfg = base_config(tmp_path, optim="lomo", max_steps=1)
    return Trainer(TinyRegressor(), cfg, train_dataset=_data())


def test_a_gradient_scaler_or_several_processes_are_refused(tmp_path, monkeypatch):
    trainer = _lomo_trainer(tmp_path / "scaler")
    monkeypatch.setattr(trainer.strategy.precision, "uses_grad_scaler", True)  # fp16 (no fp16 kernels on this CPU)
    with pytest.raises(ConfigError, match="Lomo updates each parameter inside backward, before a gradient scaler"):
        trainer.fit()
    trainer = _lomo_trainer(tmp_path / "ranks")
    monkeypatch.setattr(trainer.strategy, "world_size", 2)
    with pytest.raises(ConfigError, match="before gradients could be averaged across processes"):
        trainer.fit()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_adalomo_without_cuda_is_one_sentence(tmp_path):
    with pytest.raises(ValueError, match="Optimizer 'adalomo' needs a CUDA GPU"):
        Trainer(TinyRegressor(), base_config(tmp_path, optim="adalomo", max_steps=1), train_dataset=_data()).fit()
