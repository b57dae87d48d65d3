"""Apex AMP: a clear start-up error without NVIDIA apex (always the case here), and the happy path
against a mocked `apex.amp` injected into sys.modules."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
from torch import nn

from kiln.precision import build_precision
from kiln.precision.apex import ApexPrecision
from kiln.precision.base import PrecisionError

CPU = torch.device("cpu")


@pytest.fixture
def no_apex(monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", None)  # `import apex` raises ImportError
    monkeypatch.delitem(sys.modules, "apex.amp", raising=False)


class FakeAmp(types.ModuleType):
    """Records what kiln calls; scales the loss by 8 and unscales on exit, as apex does."""

    def __init__(self) -> None:
        super().__init__("apex.amp")
        self.calls: list[tuple] = []
        self.scale = 8.0
        self.loaded: list[dict] = []

    def initialize(self, model, optimizer, opt_level="O1"):
        self.calls.append(("initialize", model, optimizer, opt_level))
        return model, optimizer

    @contextlib.contextmanager
    def scale_loss(self, loss, optimizer):
        self.calls.append(("scale_loss", optimizer))
        yield loss * self.scale
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(self.scale)

    def state_dict(self):
        return {"loss_scaler0": {"loss_scale": self.scale, "unskipped": 3}}

    def load_state_dict(self, state):
        self.loaded.append(state)
        self.scale = state["loss_scaler0"]["loss_scale"]


@pytest.fixture
def fake_amp(monkeypatch) -> FakeAmp:
    amp = FakeAmp()
    apex = types.ModuleType("apex")
    apex.amp = amp  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.amp", amp)
    return amp


def test_missing_apex_is_reported_at_start_up(make_config, no_apex):
    plugin = build_precision(make_config(name="fp16", half_precision_backend="apex"))
    with pytest.raises(PrecisionError) as err:
        plugin.check_device(torch.device("cuda", 0))
    msg = str(err.value)
    assert "needs NVIDIA apex, which is not installed" in msg
    assert "from source" in msg and "github.com/NVIDIA/apex" in msg and "CUDA" in msg
    assert "precision: fp16" in msg


def test_pypi_apex_is_named_as_the_wrong_package(make_config, monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))
    monkeypatch.setitem(sys.modules, "apex.amp", None)
    with pytest.raises(PrecisionError, match="is not NVIDIA apex: PyPI's `apex` is unrelated"):
        ApexPrecision(make_config(name="apex")).check_device(CPU)


def test_apex_without_cuda_is_rejected(make_config, fake_amp):
    with pytest.raises(PrecisionError) as err:
        ApexPrecision(make_config(name="apex")).check_device(CPU)
    msg = str(err.value)
    assert "needs a CUDA GPU" in msg and "'cpu'" in msg and "precision: bf16" in msg


def test_importing_the_plugin_does_not_import_apex(no_apex):
    ApexPrecision(None)  # constructing is fine; only using apex needs it


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_mocked_apex_happy_path(level, make_config, fake_amp):
    plugin = build_precision(make_config(name="fp16", half_precision_backend="apex", fp16_opt_level=level))
    assert isinstance(plugin, ApexPrecision)
    torch.manual_seed(0)
    model, ref = nn.Linear(4, 2), nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, wrapped_opt = plugin.connect(model, opt)
    assert fake_amp.calls[0] == ("initialize", model, opt, level)
    assert (wrapped, wrapped_opt) == (model, opt)

    x = torch.randn(8, 4)
    with plugin.forward_context():
        loss = model(x).pow(2).mean()
    plugin.backward(loss)
    assert fake_amp.calls[1] == ("scale_loss", opt)
    plugin.unscale_gradients(opt)  # apex already unscaled on exiting scale_loss
    ref.zero_grad()
    ref(x).pow(2).mean().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad)
    assert plugin.optimizer_step(opt) is True and plugin.skipped_steps == 0


def test_mocked_apex_overflow_skip_is_reported(make_config, fake_amp):
    plugin = ApexPrecision(make_config(name="apex"))
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plugin.connect(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    # what apex's scale_loss does on overflow: a one-shot step that does nothing, flagged on the stash
    opt._amp_stash = types.SimpleNamespace(already_patched=True)

    def skip_step(closure=None):
        opt._amp_stash.already_patched = False
        del opt.step

    opt.step = skip_step
    assert plugin.optimizer_step(opt) is False
    assert plugin.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_mocked_apex_state_round_trip_waits_for_initialize(make_config, fake_amp):
    plugin = ApexPrecision(make_config(name="apex"))
    plugin.load_state_dict({"amp": {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 5}}, "skipped_steps": 2})
    assert fake_amp.loaded == [] and plugin.skipped_steps == 2  # apex may only load after initialize
    model = nn.Linear(2, 2)
    plugin.connect(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert fake_amp.loaded == [{"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 5}}]
    assert plugin.state_dict() == {"amp": {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 3}}, "skipped_steps": 2}


def test_backward_before_connect_says_what_is_missing(make_config, fake_amp):
    with pytest.raises(RuntimeError, match=r"connect\(module, optimizer\) must be called before backward"):
        ApexPrecision(make_config(name="apex")).backward(torch.ones((), requires_grad=True))
