"""HF's two param groups stepped as one while their settings agree (kiln/optim/merged_step.py): the same
weights and state bit for bit, one group's kernels a step, HF's layout everywhere outside `step()`, and the
cases it must leave alone."""

from __future__ import annotations

import collections
import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.optim.merged_step import step_equal_groups_as_one
from kiln.optim.optimizers import parameter_groups


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.norm, self.b = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.norm(self.a(x))))


def _optimizer(net: nn.Module, cls: type = torch.optim.AdamW, decay: float = 0.0, **kw: Any) -> torch.optim.Optimizer:
    return cls(parameter_groups(net, decay), lr=1e-2, **kw)


def _train(net: nn.Module, opt: torch.optim.Optimizer, steps: int, sched: Any = None) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=g)
        net(x).pow(2).mean().backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)


class ForeachCount(TorchDispatchMode):
    """How many foreach kernels a step dispatches: one per group and update term (the launches on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "_foreach_" in str(func.overloadpacket):
            self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _foreach_calls(net: nn.Module, opt: torch.optim.Optimizer) -> int:
    net(torch.ones(2, 8)).sum().backward()
    with ForeachCount() as counter:
        opt.step()
    opt.zero_grad()
    return sum(counter.calls.values())


def _pair(make: Callable[[nn.Module], torch.optim.Optimizer]) -> tuple[nn.Module, Any, nn.Module, Any]:
    grouped, merged = Net(), Net()
    a, b = make(grouped), make(merged)
    assert step_equal_groups_as_one(b)
    return grouped, a, merged, b


def _assert_same(net_a: nn.Module, opt_a: Any, net_b: nn.Module, opt_b: Any) -> None:
    for p, q in zip(net_a.parameters(), net_b.parameters()):
        assert torch.equal(p, q)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for key, value in sa["state"][i].items():
            assert torch.equal(value, sb["state"][i][key]), (i, key)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda net: _optimizer(net), id="adamw"),
        pytest.param(lambda net: _optimizer(net, foreach=True), id="adamw-foreach"),
        pytest.param(lambda net: _optimizer(net, fused=True), id="adamw-fused"),
        pytest.param(lambda net: _optimizer(net, torch.optim.SGD, momentum=0.9, nesterov=True), id="sgd-nesterov"),
        pytest.param(lambda net: _optimizer(net, torch.optim.Adagrad), id="adagrad"),
    ],
)
def test_weights_and_state_are_those_of_the_grouped_step_bit_for_bit(make: Any) -> None:
    grouped, a, merged, b = _pair(make)
    sched_a = torch.optim.lr_scheduler.LambdaLR(a, lambda s: 1.0 - s / 20)
    sched_b = torch.optim.lr_scheduler.LambdaLR(b, lambda s: 1.0 - s / 20)
    _train(grouped, a, 12, sched_a)
    _train(merged, b, 12, sched_b)
    _assert_same(grouped, a, merged, b)


def test_a_step_launches_one_groups_foreach_kernels_and_keeps_hfs_layout_outside_it() -> None:
    grouped, a, merged, b = _pair(lambda net: _optimizer(net, foreach=True))
    groups = b.param_groups
    ids = [id(g) for g in groups]
    once, twice = _foreach_calls(merged, b), _foreach_calls(grouped, a)
    assert 0 < once and twice == 2 * once
    assert b.param_groups is groups and [id(g) for g in b.param_groups] == ids and len(groups) == 2
    assert [len(g["params"]) for g in groups] == [len(g["params"]) for g in a.param_groups]
    # a second step reuses the one-group view (same settings, same parameter lists)
    assert _foreach_calls(merged, b) == once


def test_groups_with_different_settings_step_grouped() -> None:
    grouped, a, merged, b = _pair(lambda net: _optimizer(net, decay=0.1, foreach=True))
    assert _foreach_calls(merged, b) == _foreach_calls(grouped, a)
    _train(grouped, a, 3)
    _train(merged, b, 3)
    _assert_same(grouped, a, merged, b)


def test_a_schedule_that_gives_the_groups_different_rates_steps_them_grouped() -> None:
    grouped, a, merged, b = _pair(lambda net: _optimizer(net, foreach=True))
    equal = _foreach_calls(merged, b)
    torch.optim.lr_scheduler.LambdaLR(b, [lambda s: 1.0, lambda s: 0.5])  # group 1 at half the rate
    assert _foreach_calls(merged, b) == 2 * equal
    b.param_groups[1]["lr"] = b.param_groups[0]["lr"]  # equal again: one group again
    assert _foreach_calls(merged, b) == equal


def test_a_tensor_setting_counts_as_different(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, merged, b = _pair(lambda net: _optimizer(net, foreach=False))
    init_group, groups_stepped = torch.optim.AdamW._init_group, []

    def counting(self: Any, group: Any, *args: Any) -> Any:
        groups_stepped.append(len(group["params"]))
        return init_group(self, group, *args)

    monkeypatch.setattr(torch.optim.AdamW, "_init_group", counting)
    _foreach_calls(merged, b)
    assert groups_stepped == [6]
    rate = torch.tensor(1e-2)
    for group in b.param_groups:
        group["lr"] = rate  # one tensor in both: the same object, so still equal
    _foreach_calls(merged, b)
    assert groups_stepped == [6, 6]
    b.param_groups[1]["lr"] = torch.tensor(1e-2)  # an equal value in another tensor: compared by identity only
    _foreach_calls(merged, b)
    assert groups_stepped == [6, 6, 2, 4]


def test_step_hooks_see_hfs_groups() -> None:
    _, _, merged, b = _pair(lambda net: _optimizer(net, foreach=True))
    equal = _foreach_calls(merged, b)
    seen = []
    handle = b.register_step_pre_hook(lambda opt, args, kwargs: seen.append(len(opt.param_groups)))
    assert _foreach_calls(merged, b) == 2 * equal and seen == [2]
    handle.remove()
    hook = register_optimizer_step_post_hook(lambda opt, args, kwargs: seen.append(len(opt.param_groups)))
    try:
        assert _foreach_calls(merged, b) == 2 * equal and seen == [2, 2]
    finally:
        hook.remove()
    assert _foreach_calls(merged, b) == equal


def test_a_group_added_later_joins_the_merged_step() -> None:
    _, _, merged, b = _pair(lambda net: _optimizer(net, foreach=True))
    equal = _foreach_calls(merged, b)
    extra = nn.Parameter(torch.ones(3))
    b.add_param_group({"params": [extra], "weight_decay": 0.0})
    extra.grad = torch.ones(3)
    assert _foreach_calls(merged, b) == equal  # three groups, one set of kernels, and the new parameter moved
    assert not torch.equal(extra.detach(), torch.ones(3))
    b.param_groups[2]["params"].append(nn.Parameter(torch.ones(2)))  # the same list, one more parameter
    b.param_groups[2]["params"][-1].grad = torch.ones(2)
    _foreach_calls(merged, b)
    assert not torch.equal(b.param_groups[2]["params"][-1].detach(), torch.ones(2))


def test_an_error_inside_the_step_leaves_hfs_groups_in_place() -> None:
    _, _, merged, b = _pair(lambda net: _optimizer(net))
    groups = b.param_groups
    merged(torch.ones(2, 8)).sum().backward()
    broken = (None, None)
    for group in groups:
        group["betas"] = broken  # equal settings, so the merged step runs, and fails inside
    with pytest.raises(TypeError):
        b.step()
    assert b.param_groups is groups


def test_a_later_scheduler_does_not_wrap_it_and_sees_the_step_called() -> None:
    net = Net()
    opt = _optimizer(net)
    assert step_equal_groups_as_one(opt)
    step = opt.step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    assert opt.step is step
    net(torch.ones(2, 8)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Detected call of `lr_scheduler.step()` before `optimizer.step()`"
        opt.step()
        sched.step()


def test_a_checkpoint_of_the_merged_optimizer_loads_into_a_grouped_one() -> None:
    _, _, merged, b = _pair(lambda net: _optimizer(net))
    _train(merged, b, 2)
    state = copy.deepcopy(b.state_dict())
    assert len(state["param_groups"]) == 2
    fresh = _optimizer(Net())
    fresh.load_state_dict(state)
    assert len(fresh.param_groups) == 2


class OwnAdamW(torch.optim.AdamW):
    pass


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda net: None, id="no optimizer"),
        pytest.param(lambda net: torch.optim.AdamW(net.parameters()), id="one group"),
        pytest.param(lambda net: OwnAdamW(parameter_groups(net, 0.0)), id="a subclass"),
        pytest.param(lambda net: torch.optim.LBFGS(net.parameters()), id="not a read-only step"),
    ],
)
def test_it_leaves_other_optimizers_alone(make: Any) -> None:
    opt = make(Net())
    step = getattr(opt, "step", None)
    assert not step_equal_groups_as_one(opt)
    assert getattr(opt, "step", None) == step


def test_it_installs_once_and_never_over_a_compiled_step() -> None:
    opt = _optimizer(Net())
    assert step_equal_groups_as_one(opt) and not step_equal_groups_as_one(opt)
    compiled = _optimizer(Net())
    compiled.step = lambda *a, **k: None  # type: ignore[method-assign]
    compiled.step._kiln_compiled = True  # type: ignore[attr-defined]
    assert not step_equal_groups_as_one(compiled)


def test_groups_that_together_mix_meshes_step_grouped() -> None:
    """A tp plan can leave one group all DTensors and the other all plain: no one kernel call spans both."""
    grouped, a, merged, b = _pair(lambda net: _optimizer(net, foreach=True))
    mesh = object()
    for p in b.param_groups[0]["params"]:
        p.device_mesh = mesh  # stands in for a DTensor's mesh (kiln.utils.kernels.mixes_meshes reads only this)
    b.param_groups[0]["params"] = list(b.param_groups[0]["params"])  # a new list: the view is rebuilt
    assert _foreach_calls(merged, b) == _foreach_calls(grouped, a)
    for p in b.param_groups[1]["params"]:
        p.device_mesh = mesh  # one mesh throughout: one group again
    b.param_groups[1]["params"] = list(b.param_groups[1]["params"])
    assert 2 * _foreach_calls(merged, b) == _foreach_calls(grouped, a)


def test_after_loading_a_state_dict_it_steps_the_loaded_groups() -> None:
    """`load_state_dict` replaces the group dicts and their parameter lists: the view follows them."""
    grouped, a, merged, b = _pair(lambda net: _optimizer(net, foreach=True))
    _train(grouped, a, 3)
    _train(merged, b, 3)
    saved = copy.deepcopy(a.state_dict())
    a.load_state_dict(saved)
    b.load_state_dict(copy.deepcopy(saved))
    assert 2 * _foreach_calls(merged, b) == _foreach_calls(grouped, a)  # one group's kernels after the load too
    _train(grouped, a, 3)
    _train(merged, b, 3)
    _assert_same(grouped, a, merged, b)


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_a_grad_scalers_step_goes_through_it(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """GradScaler calls `optimizer.step()`, with a fused optimizer's scale and inf flag set on the optimizer."""
    grouped, a, merged, b = _pair(lambda net: _optimizer(net, fused=fused))
    kernel, calls = torch._fused_adamw_, collections.Counter()
    for net, opt in ((grouped, a), (merged, b)):
        counted = lambda *args, _opt=opt, **kw: calls.update([id(_opt)]) or kernel(*args, **kw)  # noqa: E731
        monkeypatch.setattr(torch, "_fused_adamw_", counted)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            scaler.scale(net(torch.randn(5, 8, generator=g)).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    _assert_same(grouped, a, merged, b)
    assert (calls[id(a)], calls[id(b)]) == ((8, 4) if fused else (0, 0))


def test_a_closure_reaches_the_step_by_position_and_by_name() -> None:
    _, _, merged, b = _pair(lambda net: _optimizer(net, foreach=True))
    merged(torch.ones(2, 8)).sum().backward()
    with ForeachCount() as counter:
        assert b.step(lambda: torch.tensor(3.0)) == 3.0
        assert b.step(closure=lambda: torch.tensor(4.0)) == 4.0
    assert sum(counter.calls.values()) == 2 * _foreach_calls(merged, b)  # both merged steps


def test_the_one_group_view_is_built_once_and_rebuilt_when_the_groups_change(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, merged, b = _pair(lambda net: _optimizer(net))
    init_group, seen = torch.optim.AdamW._init_group, []

    def recording(self: Any, group: Any, *args: Any) -> Any:
        seen.append(group["params"])
        return init_group(self, group, *args)

    monkeypatch.setattr(torch.optim.AdamW, "_init_group", recording)
    _foreach_calls(merged, b)
    _foreach_calls(merged, b)
    assert len(seen) == 2 and seen[0] is seen[1] and len(seen[0]) == 6  # one list, kept between steps
    b.param_groups[1]["params"] = list(b.param_groups[1]["params"])  # a new list with the same parameters
    _foreach_calls(merged, b)
    assert seen[2] is not seen[1] and all(p is q for p, q in zip(seen[2], seen[1], strict=True))
