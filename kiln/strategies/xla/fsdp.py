"""`strategy: xla_fsdp`: fully sharded data parallel on XLA devices, two ways (xla_fsdp_options.py).

- `spmd` (default; HF `xla_fsdp_v2: true`): SPMD FSDPv2. ONE process drives every device of the
  host through a mesh `("fsdp", "model")` of shape (devices, 1); every parameter is sharded on its
  first dimension over the fsdp axis (`SpmdFullyShardedDataParallel`) and every batch on its first
  dimension, and the XLA compiler inserts the all-gathers and reduce-scatters. The configured batch
  is therefore the global batch, split over the devices (as in HF); gradients come out global, so
  `grad_divisor` is 1 and the numbers equal one device's. Auto-wrapped blocks (by class or size)
  get what an inner FSDPv2 wrapper gives them -- their output sharded on the batch dimension, a
  backward optimization barrier, and activation checkpointing when asked -- without a wrapper
  module, so parameter names stay the user's. Checkpoints: sharded per device with DCP and
  torch_xla's SPMD planners (xla_fsdp_checkpoint_io.py).
- `classic` (HF `xla_fsdp_v2: false`): torch_xla's `XlaFullyShardedDataParallel`, one process per
  device, configured by `settings` (HF `xla_fsdp_settings`). Run here with one device only: on PJRT
  CPU two devices deadlock in the wrapper's first collective (see docs/xla.md).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch import nn

from kiln.strategies import STRATEGIES
from kiln.strategies.base import StepResult
from kiln.strategies.capabilities import Capabilities
from kiln.strategies.checkpoint_io import CheckpointIO
from kiln.strategies.xla.strategy import XLA_PRECISIONS, XLA_REASONS, XLAStrategy
from kiln.strategies.xla.fsdp_options import OPTIONS, XLAFSDPSettings, check_activation_checkpointing, resolve
from kiln.utils.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.precision.base import Precision

log = logging.getLogger(__name__)


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


@contextlib.contextmanager
def _original_parameters(wrapped: nn.Module) -> Iterator[None]:
    """Register the classic wrapper's full parameters back on the modules they came from, for the
    time of the `with` block (XlaFullyShardedDataParallel keeps them in `full_param_infos`)."""
    placed = []
    for unit in wrapped.modules():
        for (_name, owner, attr), param in zip(getattr(unit, "full_param_infos", ()), getattr(unit, "full_params", ())):
            owner._parameters[attr] = param
            placed.append((owner, attr, param))
        for _name, _shared_name, owner, attr, shared_owner, shared_attr in getattr(unit, "shared_full_param_infos", ()):
            owner._parameters[attr] = getattr(shared_owner, shared_attr)
            placed.append((owner, attr, getattr(shared_owner, shared_attr)))
    try:
        yield
    finally:
        for owner, attr, param in placed:
            owner._parameters.pop(attr, None)
            object.__setattr__(owner, attr, param)


@STRATEGIES.register("xla_fsdp")
class XLAFSDPStrategy(XLAStrategy):
    name = "xla_fsdp"
    capabilities = Capabilities(
        devices=frozenset({"xla"}), precisions=XLA_PRECISIONS, auto_batch_size=False,
        full_eval_cast=False, user_optimizer=False, torch_compile=False, reasons=XLA_REASONS,
    )
    options = dict(OPTIONS)
    checkpoint_formats = ("xla-spmd-sharded", "xla-fsdp-classic")

    def __init__(self, config: "DictConfig", precision: "Precision") -> None:
        self.settings: XLAFSDPSettings = XLAFSDPSettings()
        self._mesh: Any = None
        self._prefixes: dict[int, str] = {}
        super().__init__(config, precision)

    def _init_topology(self, xr: Any) -> None:
        self.settings = resolve(self.option)
        for key, why in self.settings.no_effect.items():
            log.warning("XLA FSDP setting %r has no effect: %s.", key, why)
        if self.settings.wrapper == "classic":
            return super()._init_topology(xr)
        if int(xr.process_count()) > 1:
            raise ConfigError("SPMD XLA FSDP runs as one process per host, and several hosts are not supported yet; "
                              "start one process (it drives every device of the host).")
        xr.use_spmd()  # before any tensor is placed: the one process now sees one virtual device over all
        self.world_size, self.global_rank, self.local_rank = 1, 0, 0
        self._device = self.accelerator_device()

    @property
    def spmd(self) -> bool:
        return self.settings.wrapper == "spmd"

    @property
    def persistent_gradients(self) -> bool:  # type: ignore[override]
        return self.spmd  # the classic wrapper hands its reduced shards to the optimizer itself

    @property
    def num_devices(self) -> int:
        if not self.spmd:
            return self.world_size
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
    def setup(self, module: nn.Module, optimizer_factory: Optional[Any] = None, scheduler_factory: Optional[Any] = None,
              *, max_steps: Optional[int] = None) -> Any:
        """The classic wrapper takes the parameters away from the user's module and registers flat
        shards on itself. The optimizer is still built by the user's factory over the user's
        parameters (so weight-decay groups stay what they are), with them registered back for that
        call, and each group then points at the shards."""
        if self.spmd or optimizer_factory is None:
            return super().setup(module, optimizer_factory, scheduler_factory, max_steps=max_steps)

        def factory(wrapped: nn.Module) -> torch.optim.Optimizer:
            with _original_parameters(wrapped):
                optimizer = optimizer_factory(wrapped)
            for group in optimizer.param_groups:
                group["params"] = [getattr(p, "_sharded_param", p) for p in group["params"]]
            return optimizer

        return super().setup(module, factory, scheduler_factory, max_steps=max_steps)

    def setup_module(self, module: nn.Module) -> nn.Module:
        from kiln.strategies.fsdp.wrap import blocks_to_wrap

        self._prefixes = {id(m): name for name, m in module.named_modules()}
        module = module.to(self.root_device)
        blocks = blocks_to_wrap(module, self.settings.wrap, self.settings.min_num_params)
        check_activation_checkpointing(self.settings, bool(blocks))
        return self._wrap_spmd(module, blocks) if self.spmd else self._wrap_classic(module, blocks)

    def _wrap_spmd(self, module: nn.Module, blocks: list[nn.Module]) -> nn.Module:
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

    def _wrap_classic(self, module: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel, checkpoint_module

        chosen = {id(b) for b in blocks}
        kwargs = dict(self.settings.settings)
        for key in ("compute_dtype", "buffer_dtype"):
            if isinstance(kwargs.get(key), str):
                kwargs[key] = getattr(torch, kwargs[key])
        if chosen:
            kwargs["auto_wrap_policy"] = lambda module, recurse, *args, **kw: recurse or id(module) in chosen
        if chosen and self.settings.activation_checkpointing:
            kwargs["auto_wrapper_callable"] = lambda m, *args, **kw: XlaFullyShardedDataParallel(checkpoint_module(m), *args, **kw)
        try:
            return XlaFullyShardedDataParallel(module, **kwargs)
        except TypeError as err:
            raise ConfigError(f"xla_fsdp_settings (strategy.settings) holds an argument XlaFullyShardedDataParallel "
                              f"does not take ({err}); fix the settings.") from None

    def unwrap(self, model: nn.Module) -> nn.Module:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

        return model.module if isinstance(model, (SpmdFullyShardedDataParallel, XlaFullyShardedDataParallel)) else model

    def prepare_batch(self) -> Optional[Callable[[Any], Any]]:
        return self.shard_batch if self.spmd else None

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
        batch = super().batch_to_device(batch)
        return self.shard_batch(batch) if self.spmd else batch

    # -- step -------------------------------------------------------------------------------
    def optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                       max_grad_norm: Optional[float]) -> StepResult:
        """SPMD: the gradients are global already. Classic: the wrapper reduce-scattered them in
        backward, and its own clip_grad_norm_ reduces the norm over the shards."""
        self.settle_gradients()
        self.precision.unscale_gradients(optimizer)
        grad_norm = None
        if max_grad_norm:
            grad_norm = (model.clip_grad_norm_(max_grad_norm) if not self.spmd and hasattr(model, "clip_grad_norm_")
                         else self.clip_gradients(model, optimizer, max_grad_norm))
        return StepResult(self.precision.optimizer_step(optimizer), grad_norm)

    # -- checkpoints and export -------------------------------------------------------------
    def prefix_of(self, module: nn.Module) -> str:
        """Where the user's `module` sits in the module that was wrapped ("" when it is that module)."""
        return self._prefixes.get(id(module), "")

    def checkpoint_io(self) -> CheckpointIO:
        from kiln.strategies.xla.fsdp_checkpoint_io import ClassicXLAFSDPCheckpointIO, SPMDCheckpointIO

        return SPMDCheckpointIO(self) if self.spmd else ClassicXLAFSDPCheckpointIO(self)

    def model_state_for_export(self, module: nn.Module) -> dict[str, torch.Tensor]:
        if self.spmd:
            return super().model_state_for_export(module)  # CPU copies gather the shards
        from kiln.strategies.xla.fsdp_checkpoint_io import classic_full_state

        return classic_full_state(self, self._wrapped, module)
