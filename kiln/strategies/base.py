"""The Strategy interface: where the model lives, how it is replicated or sharded, and how
gradients, optimizer steps, collectives and checkpoints work across processes.

The engine calls only these methods, in this order, for every strategy (single, DDP, FSDP,
DeepSpeed, XLA, MPS); a new strategy is one file implementing them plus a registry line:

    strategy.setup_environment()                       # process group, device
    wrapped, opt = strategy.setup(module, make_optimizer)
    per micro-batch:  batch_to_device -> (no_sync) -> backward
    per step:         clip_grad_norm -> optimizer_step -> zero_grad
    checkpoints:      save_checkpoint / load_checkpoint / model_state_for_export
    strategy.teardown()
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager, Iterable

import torch
from torch import nn

from kiln.utils.tensors import move_to_device

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.precision.base import Precision

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


class Strategy:
    """Single-process defaults; distributed strategies override the collective and wrapping parts."""

    name: ClassVar[str] = "base"

    def __init__(self, config: "DictConfig", precision: "Precision") -> None:
        self.config = config
        self.precision = precision

    # -- topology ---------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        raise NotImplementedError

    world_size: int = 1
    global_rank: int = 0
    local_rank: int = 0
    node_rank: int = 0

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def is_local_zero(self) -> bool:
        return self.local_rank == 0

    @property
    def data_parallel_size(self) -> int:
        """Number of distinct data shards (ranks that see different batches)."""
        return self.world_size

    @property
    def data_parallel_rank(self) -> int:
        return self.global_rank

    # -- set-up -----------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Initialise the process group / device. Safe to call more than once."""

    def connect_precision(self, precision: "Precision") -> "Precision":
        """Return the precision plugin this strategy will really use (FSDP/DeepSpeed may substitute
        their own flavour; they must log that they did)."""
        self.precision = precision
        return precision

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move to the device and wrap (DDP, FSDP...). Returns the module to run forward on."""
        return module.to(self.root_device)

    def setup_optimizer(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Hook for strategies that wrap model and optimizer together (DeepSpeed); by default the
        precision plugin gets to connect them (apex's amp.initialize)."""
        return self.precision.connect(module, optimizer)

    def setup(self, module: nn.Module, make_optimizer: OptimizerFactory) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap the module, then build the optimizer over the wrapped parameters (FSDP shards them
        first), then let the strategy wrap both."""
        wrapped = self.setup_module(module)
        optimizer = make_optimizer(wrapped)
        return self.setup_optimizer(wrapped, optimizer)

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper `setup_module` added."""
        return module

    def process_dataloader(self, dataloader: Iterable[Any]) -> Iterable[Any]:
        """Hook for device-feeding loaders (XLA's MpDeviceLoader)."""
        return dataloader

    def batch_to_device(self, batch: Any) -> Any:
        """Move to the device, then let the precision plugin cast inputs (true half precision)."""
        return self.precision.convert_input(move_to_device(batch, self.root_device))

    # -- step -------------------------------------------------------------------------------
    def no_sync(self, module: nn.Module, enabled: bool) -> ContextManager[Any]:
        """Skip gradient synchronisation for micro-batches that are not the last of a window."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, module: nn.Module) -> None:
        self.precision.backward(loss)

    def clip_grad_norm(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Unscale, then clip all gradients to `max_norm`; returns the total norm before clipping."""
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def optimizer_step(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """Step; returns False when the precision plugin skipped the step (inf/nan gradients)."""
        return self.precision.optimizer_step(optimizer)

    def zero_grad(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    # -- collectives (identity on one process) ----------------------------------------------
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return tensor

    def reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Callable[[], torch.Tensor]:
        """Start `reduce` and return a function that waits for it and gives the result, so the
        communication overlaps with the caller's work (e.g. a forward pass) instead of stalling it."""
        done = self.reduce(tensor, op)
        return lambda: done

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stack `tensor` from every rank along a new first dimension."""
        return tensor.unsqueeze(0)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank."""

    # -- checkpoints ------------------------------------------------------------------------
    def checkpoint_io(self) -> "Any":
        """The object that writes/reads this strategy's model and optimizer files."""
        from kiln.strategies.checkpoint_io import FullStateCheckpointIO

        return FullStateCheckpointIO(self)

    def model_state_for_export(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full, unsharded weights of the user's module (called on every rank; used on rank 0)."""
        return self.unwrap(module).state_dict()

    def teardown(self) -> None:
        """Release the process group and device state."""
