"""Numbers without the Trainer: each plugin's hooks, driven as the loop drives them, give exactly
the weights of a hand-written torch loop, and mixed precision trains as well as fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.precision.amp import BF16MixedPrecision, FP16MixedPrecision
from kiln.precision.base import Precision
from kiln.precision.fp32 import FP32Precision

CPU = torch.device("cpu")
STEPS = 30


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(128, 16, generator=g)
    return x, (x[:, :4] * 2 - x[:, 4:8]).sin()  # a smooth target the MLP can fit


def _train_with(plugin: Precision, max_norm: float = 1.0) -> tuple[nn.Module, list[float]]:
    """The loop's calls, in the loop's order."""
    plugin.check_device(CPU)
    model = plugin.convert_module(_mlp())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    plugin.setup()
    x, y = _data()
    losses = []
    for _ in range(STEPS):
        xb, yb = plugin.convert_input((x, y))
        with plugin.forward_context():
            loss = nn.functional.mse_loss(model(xb), yb)
        plugin.backward(loss)
        plugin.unscale_gradients(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        plugin.optimizer_step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    plugin.teardown()
    return model, losses


def _train_by_hand(dtype: torch.dtype | None, scaler: bool, max_norm: float = 1.0) -> nn.Module:
    """The same run written directly against torch.amp."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gs = torch.amp.GradScaler("cpu") if scaler else None
    x, y = _data()
    for _ in range(STEPS):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = nn.functional.mse_loss(model(x), y)
        if gs is not None:
            gs.scale(loss).backward()
            gs.unscale_(opt)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if gs is not None:
            gs.step(opt)
            gs.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def _assert_identical(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_fp32_hooks_match_a_hand_written_loop(make_config):
    model, _ = _train_with(FP32Precision(make_config()))
    _assert_identical(model, _train_by_hand(None, scaler=False))


def test_bf16_hooks_match_a_hand_written_autocast_loop(make_config):
    model, _ = _train_with(BF16MixedPrecision(make_config(name="bf16")))
    _assert_identical(model, _train_by_hand(torch.bfloat16, scaler=False))


def test_fp16_hooks_match_a_hand_written_grad_scaler_loop(make_config, fp16_cpu):
    model, _ = _train_with(FP16MixedPrecision(make_config(name="fp16")))
    _assert_identical(model, _train_by_hand(torch.float16, scaler=True))


@pytest.mark.parametrize(
    "name, gap",
    [("bf16", 0.01), ("fp16", 0.01), ("bf16-true", 0.02)],
)
def test_reduced_precision_trains_within_a_small_gap_of_fp32(name, gap, make_config, fp16_cpu):
    from kiln.precision import build_precision

    _, ref = _train_with(FP32Precision(make_config()))
    _, losses = _train_with(build_precision(make_config(name=name)))
    assert ref[-1] < 0.1 * ref[0]  # the task is learnt at all
    assert losses[-1] < 0.1 * losses[0]
    assert abs(losses[-1] - ref[-1]) <= gap * ref[0], (name, losses[-1], ref[-1])
