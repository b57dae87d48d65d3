"""Two test-only strategies that prove the seams: each passes the contract suite with no change to
kiln/engine/.

- `OwnStepStrategy` owns the optimizer step the way DeepSpeed does: `setup` wraps model and
  optimizer together into one engine object (only once an optimizer exists; evaluation before
  training gets the bare module), the engine clips inside its own `step()`, and it must be told the
  accumulation boundary (stepping without one is an error).
- `SpmdSizesStrategy` has SPMD's sizes: one process driving several devices, so the sampler has one
  shard and the gradient divisor is 1 while `num_devices` is 2. An engine that used the device count
  for the sampler or the loss weights would train on other data or with other weights than `single`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from kiln.strategies.base import Setup, SingleProcessCollectives, StepResult, Strategy
from kiln.strategies.capabilities import Capabilities
from kiln.strategies.checkpoint_io import CheckpointIO, register_format
from kiln.strategies.full_checkpoint_io import FullStateCheckpointIO
from kiln.strategies.single import SingleDeviceStrategy
from kiln.utils.errors import CheckpointError, safe_torch_load


class Engine(nn.Module):
    """Model and optimizer wrapped together, as `deepspeed.initialize` returns them."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()
        self.module, self.optimizer = module, optimizer
        self.at_boundary = False
        self.micro_batches = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        loss.backward()
        self.micro_batches += 1
        self.at_boundary = boundary

    def step(self, max_norm: float | None) -> torch.Tensor | None:
        if not self.at_boundary:
            raise RuntimeError("Engine.step() without an accumulation boundary")
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm) if max_norm else None
        self.optimizer.step()
        self.at_boundary = False
        return norm


@register_format
class EngineCheckpointIO(CheckpointIO):
    """One file with the engine's model and optimizer state (a format of its own)."""

    format = "fake-engine"
    reshardable = True
    FILE = "engine_state.pt"

    def save(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: Any,
        save_optimizer: bool,
        safetensors: bool,
        writer: bool,
    ) -> None:
        if writer:
            state = {
                "module": module.state_dict(),
                "optimizer": optimizer.state_dict() if save_optimizer and optimizer else None,
            }
            torch.save(state, os.path.join(directory, self.FILE))

    def load(
        self, directory: str, *, model: nn.Module, module: nn.Module, optimizer: Any, load_optimizer: bool = True
    ) -> None:
        path = os.path.join(directory, self.FILE)
        if not os.path.exists(path):  # an exported model folder: plain weights
            if load_optimizer:
                raise CheckpointError(f"{path} is missing.")
            return FullStateCheckpointIO().load_weights_only(directory, model=model, module=module)
        state = safe_torch_load(path)
        module.load_state_dict(state["module"])
        if load_optimizer and optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])

    @classmethod
    def consolidate(cls, directory: str) -> dict[str, torch.Tensor]:
        return safe_torch_load(os.path.join(directory, cls.FILE))["module"]


class OwnStepStrategy(SingleProcessCollectives, Strategy):
    name = "fake_own_step"
    capabilities = Capabilities(
        devices=frozenset({"cpu"}),
        precisions=frozenset({"fp32"}),
        user_optimizer=False,
        auto_batch_size=False,
        full_eval_cast=False,
        owns_optimizer_step=True,
    )
    checkpoint_formats = (EngineCheckpointIO.format,)

    def __init__(self, config: Any, precision: Any) -> None:
        super().__init__(config, precision)
        self.engine: Engine | None = None

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    def setup(
        self, module: nn.Module, optimizer_factory: Any = None, scheduler_factory: Any = None, *, max_steps: Any = None
    ) -> Setup:
        module = self.precision.convert_module(module).to(self.root_device)
        if optimizer_factory is None:
            return Setup(module)
        optimizer = optimizer_factory(module)
        self.engine = Engine(module, optimizer)
        return Setup(self.engine, optimizer, scheduler_factory(optimizer) if scheduler_factory is not None else None)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, Engine) else model

    def backward(self, loss: torch.Tensor, model: nn.Module, *, boundary: bool = True) -> None:
        assert isinstance(model, Engine), "training must run through the engine setup() returned"
        model.backward(loss, boundary)

    def optimizer_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None
    ) -> StepResult:
        assert isinstance(model, Engine)
        return StepResult(True, model.step(max_grad_norm))

    def checkpoint_io(self) -> CheckpointIO:
        return EngineCheckpointIO()


class SpmdSizesStrategy(SingleDeviceStrategy):
    name = "fake_spmd"

    @property
    def num_devices(self) -> int:
        return 2

    @property
    def data_shards(self) -> int:
        return 1

    @property
    def grad_divisor(self) -> int:
        return 1
