"""Adam and AdamW stepping DTensor parameters through their local shards (kiln/optim/local_step.py): the
kernel gets the shards, the weights and state are those of the DTensor step bit for bit, the state stays
DTensors of the parameters' layout (what checkpoints save and reshard), and the cases it must leave alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from kiln.optim.local_step import step_dtensors_locally


@pytest.fixture
def mesh():
    """A gloo group of this process alone, and its 1-D `ep` DeviceMesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    dist.destroy_process_group()


def _params(mesh: Any) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    expert = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6, 5, generator=g), mesh, [Shard(0)]))
    return [expert, torch.nn.Parameter(torch.randn(7, generator=g))]


def _train(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, steps: int, partial: bool = False) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            grad = torch.randn(p.shape, generator=g)
            if isinstance(p, DTensor):
                layout = [Partial()] if partial else p.placements
                grad = DTensor.from_local(grad, p.device_mesh, layout, run_check=False)
            p.grad = grad
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.fixture
def kernel_inputs(monkeypatch):
    """The types of the parameters and state each call of torch's per-parameter Adam kernel receives."""
    import torch.optim.adam as adam

    seen: list[set[type]] = []
    kernel = adam._single_tensor_adam

    def spy(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], *a: Any, **k: Any):
        seen.append({type(t) for t in (*params, *grads, *exp_avgs)})
        return kernel(params, grads, exp_avgs, *a, **k)

    monkeypatch.setattr(adam, "_single_tensor_adam", spy)
    return seen


@pytest.mark.parametrize(
    ("cls", "kw"),
    [(torch.optim.AdamW, {"weight_decay": 0.1}), (torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.01})],
)
def test_the_kernel_steps_local_shards_and_gives_the_dtensor_step_bitwise(mesh, kernel_inputs, cls, kw):
    want_params, got_params = _params(mesh), _params(mesh)
    want = cls(want_params, lr=1e-2, foreach=False, **kw)
    got = cls(got_params, lr=1e-2, foreach=False, **kw)
    assert step_dtensors_locally(got)
    _train(want_params, want, 3)
    assert all(DTensor in types for types in kernel_inputs)  # torch's step: DTensors throughout
    kernel_inputs.clear()
    _train(got_params, got, 3)
    assert kernel_inputs and all(types == {torch.Tensor, torch.nn.Parameter} for types in kernel_inputs)
    for w, g in zip(want_params, got_params):
        assert type(w) is type(g) and torch.equal(
            w.full_tensor() if isinstance(w, DTensor) else w, g.full_tensor() if isinstance(g, DTensor) else g
        )
    want_state, got_state = want.state_dict(), got.state_dict()
    assert want_state["param_groups"] == got_state["param_groups"]
    for index, state in want_state["state"].items():
        assert state.keys() == got_state["state"][index].keys()
        for key, value in state.items():
            theirs = got_state["state"][index][key]
            assert type(theirs) is type(value)  # DTensor state stays DTensor, of the parameter's layout
            if isinstance(value, DTensor):
                assert theirs._spec == value._spec and torch.equal(theirs.to_local(), value.to_local())
            else:
                assert torch.equal(theirs, value)


def test_a_gradient_of_another_layout_steps_as_torch_does(mesh, kernel_inputs):
    """A Partial gradient needs DTensor's redistribution: the group keeps its DTensors, with the same result."""
    want_params, got_params = _params(mesh), _params(mesh)
    want = torch.optim.AdamW(want_params, lr=1e-2, foreach=False)
    got = torch.optim.AdamW(got_params, lr=1e-2, foreach=False)
    assert step_dtensors_locally(got)
    _train(want_params, want, 2, partial=True)
    kernel_inputs.clear()
    _train(got_params, got, 2, partial=True)
    assert kernel_inputs and all(DTensor in types for types in kernel_inputs)
    assert torch.equal(want_params[0].full_tensor(), got_params[0].full_tensor())


def test_the_fused_kernel_is_left_to_torch(mesh, monkeypatch):
    """Its grad scaling and inf check read the tensors as a whole: the group keeps its DTensors."""
    import torch.optim.adam as adam

    seen: list[set[type]] = []
    kernel = adam._fused_adam

    def spy(params: list[torch.Tensor], *a: Any, **k: Any) -> Any:
        seen.append({type(t) for t in params})
        return kernel(params, *a, **k)

    monkeypatch.setattr(adam, "_fused_adam", spy)
    params = _params(mesh)[:1]
    fused = torch.optim.AdamW(params, lr=1e-2, fused=True)
    assert step_dtensors_locally(fused)
    _train(params, fused, 1)
    assert seen == [{DTensor}]


def test_optimizers_it_does_not_install_on(mesh):
    params = _params(mesh)

    class Mine(torch.optim.AdamW):
        pass

    assert not step_dtensors_locally(None)
    assert not step_dtensors_locally(torch.optim.SGD(params, lr=0.1))
    assert not step_dtensors_locally(Mine(params))
    assert not step_dtensors_locally(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))  # no DTensor
    compiled = torch.optim.AdamW(params)
    step = compiled.step
    compiled.step = lambda *a, **k: step(*a, **k)  # type: ignore[method-assign]
    compiled.step._kiln_compiled = True  # type: ignore[attr-defined]  # what compile_optimizer_step marks
    assert not step_dtensors_locally(compiled)
    once = torch.optim.Adam(params)
    assert step_dtensors_locally(once) and not step_dtensors_locally(once)


@pytest.mark.parametrize(
    ("optim", "strategy", "installed"),
    [("adamw_torch_fused", "fsdp", True), ("sgd", "fsdp", False), ("adamw_torch", "single", False)],
)
def test_a_fit_installs_it_on_adam_over_dtensors(tmp_path, optim, strategy, installed):
    """FSDP's parameters are DTensors (one process here); a plain model's are not, and its step stays torch's."""
    from kiln import Trainer
    from tests.distributed import compile_toy as toy

    cfg = toy.kiln_config(
        str(tmp_path),
        batch=4,
        eval_batch=4,
        torch_compile_backend=None,
        eval_strategy="no",
        optim=optim,
        strategy=strategy,
    )
    trainer = Trainer(toy.mlp(), cfg, train_dataset=toy.regression_data(8))
    try:
        trainer.fit()
        assert getattr(trainer.optimizer._init_group, "_kiln_local", False) is installed
    finally:
        trainer.strategy.teardown()  # the group FSDP's one process made: the next test makes its own


def test_a_torch_without_adams_init_group_keeps_its_own_step(mesh, monkeypatch):
    """`_init_group` is torch's private helper: where a torch has none, the optimizer is left as torch made it."""
    monkeypatch.delattr(torch.optim.Adam, "_init_group")
    monkeypatch.delattr(torch.optim.AdamW, "_init_group", raising=False)
    assert not step_dtensors_locally(torch.optim.Adam(_params(mesh)))
