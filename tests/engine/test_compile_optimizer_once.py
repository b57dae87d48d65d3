"""`compile_optimizer_step` installs one compiled step per optimizer: a second set-up of the same
optimizer (auto_find_batch_size's restart, a second fit) keeps it rather than compiling the compiled
step again, and outside the compiled call the parameter groups hold the float learning rates that
schedulers, logs and checkpoints read."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from kiln.engine.compile import compile_optimizer_step
from kiln.strategies.capabilities import Capabilities

_PLAIN = type("Plain", (), {"capabilities": Capabilities()})()  # a strategy that declares nothing


def _train(on: bool = True) -> SimpleNamespace:
    return SimpleNamespace(torch_compile_optimizer_step=on, torch_compile_backend="eager", torch_compile_mode=None)


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def test_a_second_set_up_keeps_the_compiled_step(caplog):
    optimizer = torch.optim.SGD(_model().parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="kiln"):
        compile_optimizer_step(optimizer, _PLAIN, _train())
        compiled = optimizer.step
        assert compiled._kiln_compiled and compiled._wrapped_by_lr_sched
        compile_optimizer_step(optimizer, _PLAIN, _train())
    assert optimizer.step is compiled
    said = [r.getMessage() for r in caplog.records if "runs through torch.compile" in r.getMessage()]
    assert said == ["The optimizer step of SGD runs through torch.compile (backend 'eager')."]  # once


def test_nothing_is_installed_when_the_setting_is_off_or_there_is_no_optimizer():
    optimizer = torch.optim.SGD(_model().parameters(), lr=0.1)
    compile_optimizer_step(optimizer, _PLAIN, _train(on=False))
    assert "step" not in vars(optimizer)  # the class's own step, no instance attribute
    compile_optimizer_step(None, _PLAIN, _train())  # evaluate/predict-only set-ups have none


def _groups(model: torch.nn.Linear) -> list[dict]:
    return [{"params": [model.weight]}, {"params": [model.bias], "lr": 0.3}]  # one parameter each, own rates


def test_the_compiled_step_updates_like_the_eager_one_and_leaves_float_rates():
    eager_model, model = _model(), _model()
    eager = torch.optim.SGD(_groups(eager_model), lr=0.1, momentum=0.9)
    optimizer = torch.optim.SGD(_groups(model), lr=0.1, momentum=0.9)
    compile_optimizer_step(optimizer, _PLAIN, _train())
    x = torch.randn(3, 4)
    for rate in (0.1, 0.05):  # a schedule's change of rate between steps
        for m, opt in ((eager_model, eager), (model, optimizer)):
            opt.param_groups[0]["lr"] = rate
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()
        rates = [group["lr"] for group in optimizer.param_groups]
        assert rates == [rate, 0.3] and all(type(r) is float for r in rates)
        assert optimizer._opt_called  # what torch's scheduler wrapper would have recorded
        for a, b in zip(eager_model.parameters(), model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
