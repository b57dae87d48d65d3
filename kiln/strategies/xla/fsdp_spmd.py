"""`xla_fsdp` with `wrapper: spmd` (the default; HF `xla_fsdp_v2: true`): SPMD FSDPv2.

ONE process drives every device of the host through a mesh `("fsdp", "model")` of shape (devices, 1);
every parameter is sharded on its first dimension over the fsdp axis (`SpmdFullyShardedDataParallel`)
and every batch on its first dimension, and the XLA compiler inserts the all-gathers and
reduce-scatters. The configured batch is therefore the global batch, split over the devices (as in
HF); gradients come out global, so `grad_divisor` is 1 and the numbers equal one device's. Auto-wrapped
blocks (by class or size) get what an inner FSDPv2 wrapper gives them -- their output sharded on the
batch dimension, a backward optimization barrier, and activation checkpointing when asked -- without a
wrapper module, so parameter names stay the user's. Checkpoints: sharded per device with DCP and
torch_xla's SPMD planners (fsdp_checkpoint_io.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.strategies.base import StepResult
from kiln.strategies.checkpoint_io import CheckpointIO
from kiln.strategies.xla.fsdp_base import XLAFSDPBase
from kiln.utils.errors import ConfigError


def _shard_batch_dim(output: Any, mesh: Any) -> None:
    """Mark the first tensor of a module's output (a tensor, a tuple's first item, HF's logits)
    sharded on its batch dimension; a scalar (a loss) has none and stays as it is."""
    import torch_xla.distributed.spmd as xs

    tensor = output
    if isinstance(output, (tuple, list)):
        tensor = output[0] if output else None
    elif hasattr(output, "keys") and not isinstance(output, torch.Tensor):
        tensor = output.get("logits", next(iter(output.values()), None)) if hasattr(output, "get") else None
    if isinstance(tensor, torch.Tensor) and tensor.dim() > 0 and tensor.device.type == "xla":
        xs.mark_sharding(tensor, mesh, ("fsdp",) + (None,) * (tensor.dim() - 1))


class SPMDXLAFSDPStrategy(XLAFSDPBase):
    checkpoint_formats = ("xla-spmd-sharded",)
    _mesh: Any = None

    def _init_devices(self, xr: Any) -> None:
        if int(xr.process_count()) > 1:
            raise ConfigError(
                "SPMD XLA FSDP runs as one process per host, and several hosts are not supported yet; "
                "start one process (it drives every device of the host)."
            )
        xr.use_spmd()  # before any tensor is placed: the one process now sees one virtual device over all
        self.world_size, self.global_rank, self.local_rank = 1, 0, 0
        self._device = self.accelerator_device()

    @property
    def num_devices(self) -> int:
        import torch_xla.runtime as xr

        return int(xr.global_runtime_device_count())

    def mesh(self) -> Any:
        """The SPMD mesh: every device on the `fsdp` axis (HF's layout, axis names fsdp/model)."""
        if self._mesh is None:
            import numpy as np
            import torch_xla.distributed.spmd as xs

            n = self.num_devices
            self._mesh = xs.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
            xs.set_global_mesh(self._mesh)
        return self._mesh

    # -- set-up -----------------------------------------------------------------------------
    def wrap(self, module: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        import torch_xla.distributed.spmd as xs
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

        mesh = self.mesh()
        for block in blocks:
            if self.settings.activation_checkpointing:
                from torch_xla.distributed.fsdp import checkpoint_module

                checkpoint_module(block)
            xs.xla_sharding.apply_backward_optimization_barrier(block)
            block.register_forward_hook(lambda _m, _args, output: _shard_batch_dim(output, mesh))
        return SpmdFullyShardedDataParallel(module, mesh=mesh, shard_output=_shard_batch_dim)

    def prepare_batch(self) -> Callable[[Any], Any] | None:
        return self.shard_batch

    def shard_batch(self, batch: Any) -> Any:
        """Every tensor of the batch split over the fsdp axis on its first (batch) dimension."""
        import torch_xla
        import torch_xla.distributed.spmd as xs

        def mark(node: Any) -> None:
            if isinstance(node, torch.Tensor):
                if node.dim() > 0 and node.device.type == "xla" and not torch_xla._XLAC._get_xla_sharding_spec(node):
                    xs.mark_sharding(node, self.mesh(), ("fsdp",) + (None,) * (node.dim() - 1))
            elif isinstance(node, dict) or hasattr(node, "values") and callable(node.values):
                for value in node.values():
                    mark(value)
            elif isinstance(node, (list, tuple)):
                for value in node:
                    mark(value)

        mark(batch)
        return batch

    def batch_to_device(self, batch: Any) -> Any:
        return self.shard_batch(super().batch_to_device(batch))

    # -- step -------------------------------------------------------------------------------
    def optimizer_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None
    ) -> StepResult:
        """The gradients are global already: no reduction, the plain clip sees the true norm."""
        self.settle_gradients()
        self.precision.unscale_gradients(optimizer)
        grad_norm = self.clip_gradients(model, optimizer, max_grad_norm) if max_grad_norm else None
        return StepResult(self.precision.optimizer_step(optimizer), grad_norm)

    # -- checkpoints and export (export: CPU copies gather the shards, as XLAStrategy's) ----------
    def checkpoint_io(self) -> CheckpointIO:
        from kiln.strategies.xla.fsdp_checkpoint_io import SPMDCheckpointIO

        return SPMDCheckpointIO(self)
