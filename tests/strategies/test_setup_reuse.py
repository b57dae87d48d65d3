"""`Strategy.setup` sets a module up once per run: evaluation before training (no factories) and the
training set-up that follows reuse the same wrapped module, and a different module (a new run with
`model_init`) is set up anew. Parity tests cannot see a second wrap of the same module: `single`'s is
idempotent, but DDP would wrap and broadcast it twice."""

from __future__ import annotations

import torch

from kiln.config.load import load_config
from kiln.precision.fp32 import FP32Precision
from kiln.strategies.single import SingleDeviceStrategy


class Counting(SingleDeviceStrategy):
    def __init__(self) -> None:
        super().__init__(load_config({"strategy": {"name": "single", "device": "cpu"}}), FP32Precision())
        self.wrapped: list[torch.nn.Module] = []

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        self.wrapped.append(module)
        return super().setup_module(module)


def _factory(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_the_same_module_is_set_up_once_and_a_new_one_anew():
    strategy = Counting()
    first = torch.nn.Linear(2, 2)
    evaluated = strategy.setup(first)  # evaluation before training
    trained = strategy.setup(first, _factory, lambda opt: ("schedule of", opt))
    assert strategy.wrapped == [first] and trained.model is evaluated.model
    assert trained.optimizer.param_groups[0]["params"][0] is first.weight
    assert trained.scheduler == ("schedule of", trained.optimizer)
    second = torch.nn.Linear(2, 2)
    again = strategy.setup(second, _factory)
    assert strategy.wrapped == [first, second] and again.model is not trained.model and again.scheduler is None


def test_setup_gives_a_users_mixed_group_the_per_parameter_kernel():
    """The seam every strategy shares (kiln/utils/kernels.py): a group whose parameters mix meshes, left to
    torch's kernel choice, steps with foreach off. The tp-split case trains in tests/strategies/model_parallel."""
    model = torch.nn.Linear(2, 2)
    model.weight.device_mesh = object()  # what a tp-split weight carries; the bias stays plain
    setup = Counting().setup(model, lambda m: torch.optim.AdamW(m.parameters()))
    assert setup.optimizer.param_groups[0]["foreach"] is False
