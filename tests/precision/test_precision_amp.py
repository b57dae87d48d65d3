"""Mixed precision: fp16 with a GradScaler (skip on inf, unscale once, exact state round trip) and
bf16 autocast, plus the device rules that reject combinations before training."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from kiln.precision.amp import BF16MixedPrecision, FP16MixedPrecision
from kiln.precision.base import PrecisionError, check_dtype_on_device

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(device: torch.device = CPU) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 8, generator=g).to(device), torch.randn(32, 4, generator=g).to(device)


def _fp16(make_config, device: torch.device = CPU, init_scale: float = 2.0**10) -> FP16MixedPrecision:
    plugin = FP16MixedPrecision(
        make_config(name="fp16"), scaler=torch.amp.GradScaler(device.type, init_scale=init_scale)
    )
    plugin.check_device(device)
    return plugin


def _backward(plugin, model: nn.Module, device: torch.device = CPU) -> None:
    x, y = _batch(device)
    with plugin.forward_context():
        loss = nn.functional.mse_loss(model(x), y)
    plugin.backward(loss)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# -- fp16 ------------------------------------------------------------------------------------
def test_fp16_skips_a_step_with_an_inf_gradient(make_config, fp16_cpu):
    plugin = _fp16(make_config)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _params(model)
    _backward(plugin, model)
    model[0].weight.grad[0, 0] = float("inf")
    plugin.unscale_gradients(opt)
    assert plugin.optimizer_step(opt) is False
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert plugin.scaler.get_scale() == 2.0**9
    assert plugin.skipped_steps == 1


def test_fp16_skips_a_nan_gradient_without_an_explicit_unscale(make_config, fp16_cpu):
    plugin = _fp16(make_config)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _backward(plugin, model)
    model[2].bias.grad[0] = float("nan")
    assert plugin.optimizer_step(opt) is False
    assert plugin.skipped_steps == 1


def test_fp16_normal_step_updates_weights_and_keeps_the_scale(make_config, fp16_cpu):
    plugin = _fp16(make_config)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _params(model)
    _backward(plugin, model)
    plugin.unscale_gradients(opt)
    assert plugin.optimizer_step(opt) is True
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert plugin.scaler.get_scale() == 2.0**10 and plugin.skipped_steps == 0
    opt.zero_grad()
    _backward(plugin, model)  # the next step works too (unscale state was reset)
    plugin.unscale_gradients(opt)
    assert plugin.optimizer_step(opt) is True


def test_fp16_default_scaler_starts_at_2_16(make_config, fp16_cpu):
    plugin = FP16MixedPrecision(make_config(name="fp16"))
    plugin.check_device(CPU)
    assert plugin.scaler.get_scale() == 2.0**16 and plugin.device == CPU


def test_fp16_unscales_once_so_clipping_sees_true_norms(make_config, fp16_cpu):
    """Clip and step on the plugin's gradients must equal clip and step on unscaled gradients."""
    model, ref = _model(), _model()
    plugin = _fp16(make_config)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x, y = _batch()
    with torch.autocast("cpu", dtype=torch.float16):
        ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    max_norm = float(ref_norm) / 4  # clipping really changes the gradients
    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    ref_opt.step()

    _backward(plugin, model)
    plugin.unscale_gradients(opt)
    plugin.unscale_gradients(opt)  # a second call in the same step is a no-op
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-3, atol=0)
    assert plugin.optimizer_step(opt) is True  # must not unscale again
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-6)


def _state_roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # checkpoints are loaded this way


def test_fp16_state_dict_restores_scale_and_growth_tracker_exactly(make_config, fp16_cpu):
    plugin = FP16MixedPrecision(
        make_config(name="fp16"), scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    )
    plugin.check_device(CPU)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(6):  # one skip, then growth: scale and tracker both move
        opt.zero_grad()
        _backward(plugin, model)
        if step == 1:
            model[0].bias.grad[0] = float("inf")
        plugin.optimizer_step(opt)
    state = plugin.state_dict()
    assert (
        state["scaler"]["_growth_tracker"] == 1 and state["scaler"]["scale"] == 2.0**10 and state["skipped_steps"] == 1
    )

    fresh = FP16MixedPrecision(make_config(name="fp16"))
    fresh.load_state_dict(_state_roundtrip(copy.deepcopy(state)))
    fresh.check_device(CPU)
    assert fresh.state_dict() == state
    assert fresh.scaler.get_scale() == plugin.scaler.get_scale()
    assert fresh.scaler._get_growth_tracker() == plugin.scaler._get_growth_tracker() == 1
    assert fresh.skipped_steps == 1

    # and both continue identically
    twin = _model()
    twin.load_state_dict(model.state_dict())
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.01)
    for p, m, o in ((plugin, model, opt), (fresh, twin, twin_opt)):
        o.zero_grad()
        _backward(p, m)
        p.optimizer_step(o)
    assert fresh.state_dict() == plugin.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_fp16_scaler_state_moves_to_the_checked_device(make_config, fp16_cpu):
    plugin = FP16MixedPrecision(make_config(name="fp16"))
    plugin.load_state_dict(
        {
            "scaler": {
                "scale": 256.0,
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 2000,
                "_growth_tracker": 7,
            },
            "skipped_steps": 3,
        }
    )
    plugin.check_device(CPU)
    assert plugin.scaler.get_scale() == 256.0 and plugin.skipped_steps == 3


def test_fp16_on_a_cpu_without_fp16_kernels_warns_once_and_runs(make_config, no_fp16_kernels):
    """HF's Trainer accepts fp16 on such a CPU; kiln runs it (autocast and GradScaler('cpu') work
    there, slowly) and says so once, even when full_eval checks fp16 a second time."""
    with pytest.warns(UserWarning) as record:
        plugin = FP16MixedPrecision(make_config(name="fp16", full_eval="fp16"))
        plugin.check_device(CPU)
        FP16MixedPrecision(make_config(name="fp16")).check_device(CPU)  # a second Trainer in the process
    [msg] = [str(w.message) for w in record if "fp16" in str(w.message)]
    assert "slowly" in msg and "_is_mkldnn_fp16_supported" in msg and "precision: bf16" in msg
    torch.manual_seed(0)  # small outputs: the scaled fp16 gradients stay finite, so the step is taken
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with plugin.forward_context():
        out = model(0.1 * torch.randn(8, 4))
    assert out.dtype == torch.float16 and plugin.scaler.is_enabled()
    plugin.backward(out.float().pow(2).mean())
    before = model.weight.detach().clone()
    assert plugin.optimizer_step(opt) and not torch.equal(model.weight, before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_fp16_scaler_on_a_device_without_support_is_rejected(make_config):
    plugin = FP16MixedPrecision(make_config(name="fp16"))
    with pytest.raises(PrecisionError) as err:
        plugin.check_device(torch.device("cuda"))
    msg = str(err.value)
    assert "GradScaler does not work on 'cuda'" in msg and "precision: bf16" in msg
    with pytest.raises(PrecisionError):  # and the disabled scaler is never kept and used later
        plugin.backward(torch.ones((), requires_grad=True))


@pytest.mark.parametrize("cls", [FP16MixedPrecision, BF16MixedPrecision])
def test_a_device_without_autocast_is_rejected(cls, make_config):
    with pytest.raises(PrecisionError, match="needs autocast, which torch does not support on 'meta'"):
        cls(make_config()).check_device(torch.device("meta"))


@pytest.mark.parametrize("backend, device", [("cuda_amp", "cpu"), ("cpu_amp", "cuda")])
def test_half_precision_backend_must_match_the_device(backend, device, make_config):
    with pytest.raises(PrecisionError, match=f"half_precision_backend is '{backend}'.*'auto'"):
        BF16MixedPrecision(make_config(half_precision_backend=backend)).check_device(torch.device(device))


@pytest.mark.parametrize("backend", ["auto", "cpu_amp"])
def test_cpu_backends_autocast_on_cpu(backend, make_config):
    plugin = BF16MixedPrecision(make_config(half_precision_backend=backend))
    plugin.check_device(CPU)
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu")


# -- bf16 ------------------------------------------------------------------------------------
def test_bf16_autocasts_the_forward_and_keeps_fp32_params(make_config):
    plugin = BF16MixedPrecision(make_config(name="bf16"))
    plugin.check_device(CPU)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch()
    with plugin.forward_context():
        out = model(x)
        assert out.dtype == torch.bfloat16
        loss = nn.functional.mse_loss(out.float(), y)
    assert model(x).dtype == torch.float32  # autocast ends with the context
    plugin.backward(loss)
    plugin.unscale_gradients(opt)
    assert plugin.optimizer_step(opt) is True
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert plugin.state_dict() == {} and plugin.skipped_steps == 0
    with plugin.eval_context():
        assert model(x).dtype == torch.bfloat16


def test_bf16_on_a_gpu_without_bf16_is_rejected(monkeypatch):
    monkeypatch.setattr("kiln.accelerators.cuda.cuda_supports_bf16", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    with pytest.raises(PrecisionError) as err:
        check_dtype_on_device(torch.bfloat16, torch.device("cuda", 0), "precision 'bf16'")
    msg = str(err.value)
    assert "Tesla V100" in msg and "does not support" in msg and "precision: fp16" in msg


# -- on a GPU (skipped without one) -----------------------------------------------------------
@needs_cuda
def test_cuda_fp16_skips_inf_and_steps_normally(make_config):
    device = torch.device("cuda", 0)
    plugin = _fp16(make_config, device)
    model = _model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with plugin.forward_context():
        assert model(_batch(device)[0]).dtype == torch.float16
    _backward(plugin, model, device)
    model[0].weight.grad[0, 0] = float("inf")
    assert plugin.optimizer_step(opt) is False and plugin.skipped_steps == 1
    opt.zero_grad()
    _backward(plugin, model, device)
    plugin.unscale_gradients(opt)
    assert plugin.optimizer_step(opt) is True


@needs_cuda
def test_cuda_bf16_autocast(make_config):
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no native bf16")
    device = torch.device("cuda", 0)
    plugin = BF16MixedPrecision(make_config(name="bf16"))
    plugin.check_device(device)
    model = _model().to(device)
    with plugin.forward_context():
        assert model(_batch(device)[0]).dtype == torch.bfloat16
