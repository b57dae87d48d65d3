"""`xla_fsdp` with `wrapper: classic` (HF `xla_fsdp_v2: false`): torch_xla's
`XlaFullyShardedDataParallel`, one process per device, configured by `settings` (HF
`xla_fsdp_settings`, the wrapper's keyword arguments). Run here with one device only: on PJRT CPU two
devices deadlock in the wrapper's first collective (see docs/xla.md).

The wrapper reduce-scatters gradients in backward and hands its flat shards to the optimizer itself,
so gradients are not kept allocated between steps (`persistent_gradients = False`) and its own
`clip_grad_norm_` reduces the norm over the shards. Checkpoints: each process's flat shards with the
wrapper's shard metadata (fsdp_checkpoint_io.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kiln.strategies.base import StepResult
from kiln.strategies.checkpoint_io import CheckpointIO
from kiln.strategies.xla.fsdp_base import XLAFSDPBase
from kiln.utils.errors import ConfigError


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


class ClassicXLAFSDPStrategy(XLAFSDPBase):
    checkpoint_formats = ("xla-fsdp-classic",)
    persistent_gradients = False  # the wrapper hands its reduced shards to the optimizer itself

    def setup(
        self,
        module: nn.Module,
        optimizer_factory: Any | None = None,
        scheduler_factory: Any | None = None,
        *,
        max_steps: int | None = None,
    ) -> Any:
        """The wrapper takes the parameters away from the user's module and registers flat shards on
        itself. The optimizer is still built by the user's factory over the user's parameters (so
        weight-decay groups stay what they are), with them registered back for that call, and each
        group then points at the shards."""
        if optimizer_factory is None:
            return super().setup(module, None, scheduler_factory, max_steps=max_steps)

        def factory(wrapped: nn.Module) -> torch.optim.Optimizer:
            with _original_parameters(wrapped):
                optimizer = optimizer_factory(wrapped)
            for group in optimizer.param_groups:
                group["params"] = [getattr(p, "_sharded_param", p) for p in group["params"]]
            return optimizer

        return super().setup(module, factory, scheduler_factory, max_steps=max_steps)

    def wrap(self, module: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel, checkpoint_module

        chosen = {id(b) for b in blocks}
        kwargs = dict(self.settings.settings)
        for key in ("compute_dtype", "buffer_dtype"):
            if isinstance(kwargs.get(key), str):
                kwargs[key] = getattr(torch, kwargs[key])
        if chosen:
            kwargs["auto_wrap_policy"] = lambda module, recurse, *args, **kw: recurse or id(module) in chosen
        if chosen and self.settings.activation_checkpointing:
            kwargs["auto_wrapper_callable"] = lambda m, *args, **kw: XlaFullyShardedDataParallel(
                checkpoint_module(m), *args, **kw
            )
        try:
            return XlaFullyShardedDataParallel(module, **kwargs)
        except TypeError as err:
            raise ConfigError(
                f"xla_fsdp_settings (strategy.settings) holds an argument XlaFullyShardedDataParallel "
                f"does not take ({err}); fix the settings."
            ) from None

    # -- step -------------------------------------------------------------------------------
    def optimizer_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None
    ) -> StepResult:
        """The wrapper reduce-scattered the gradients in backward; its own clip_grad_norm_ reduces
        the norm over the shards."""
        self.settle_gradients()
        self.precision.unscale_gradients(optimizer)
        grad_norm = None
        if max_grad_norm:
            clip = getattr(model, "clip_grad_norm_", None)
            grad_norm = (
                clip(max_grad_norm) if clip is not None else self.clip_gradients(model, optimizer, max_grad_norm)
            )
        return StepResult(self.precision.optimizer_step(optimizer), grad_norm)

    # -- checkpoints and export -------------------------------------------------------------
    def checkpoint_io(self) -> CheckpointIO:
        from kiln.strategies.xla.fsdp_checkpoint_io import ClassicXLAFSDPCheckpointIO

        return ClassicXLAFSDPCheckpointIO(self)

    def model_state_for_export(self, module: nn.Module) -> dict[str, torch.Tensor]:
        from kiln.strategies.xla.fsdp_checkpoint_io import classic_full_state

        return classic_full_state(self, self._wrapped, module)
