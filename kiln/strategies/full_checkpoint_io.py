"""The CheckpointIO of strategies whose ranks each hold the full model (single, DDP): one writer saves the
weights (kiln.strategies.model_weights) and `optimizer.pt`, every rank loads them, and a checkpoint saved by N
processes loads on M. It also resumes any other translatable format (kiln.strategies.format_translation)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from kiln.strategies.checkpoint_io import CheckpointIO, StagedWrite, register_format
from kiln.strategies.model_weights import apply_weights, load_weights, save_weights
from kiln.strategies.portable_state import PortableState, keyed_by_index, optimizer_names
from kiln.utils.errors import CheckpointError, safe_torch_load
from kiln.utils.host_copy import HostStaging
from kiln.utils.param_groups import regroup_optimizer_state

OPTIMIZER = "optimizer.pt"


@register_format
class FullStateCheckpointIO(CheckpointIO):
    """Every rank holds the whole model: one writer saves it, every rank loads it. A full checkpoint
    loads on any number of processes."""

    format = "full"
    translatable = True
    reshardable = True

    def __init__(self, strategy: Any = None) -> None:
        self.strategy = strategy

    @classmethod
    def consolidate(cls, directory: str) -> dict[str, torch.Tensor]:
        return load_weights(directory)

    @classmethod
    def portable(cls, directory: str) -> PortableState:
        return read_full_files(directory)

    def save(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        save_optimizer: bool,
        safetensors: bool,
        writer: bool,
    ) -> None:
        if writer:
            _write_full(
                directory,
                module.state_dict(),
                optimizer.state_dict() if save_optimizer and optimizer is not None else None,
                safetensors,
            )

    def stage(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        save_optimizer: bool,
        safetensors: bool,
        writer: bool,
        staging: HostStaging,
    ) -> StagedWrite | None:
        """Host copies of the weights and optimizer state, written by the same code as `save`, so an
        asynchronous checkpoint holds the bytes a synchronous one would. A subclass that saves otherwise
        (XLA) must stage its own way: it saves synchronously until it does.

        The module's buffers (a forward pass changes some in place: BatchNorm's statistics) are copied
        now; the parameters and the optimizer state, which only the optimizer's step changes, on a thread
        of their own while the next step's forward and backward run, and that step waits for it
        (kiln.utils.host_copy)."""
        if not self.saves_in_background():
            return None
        if not writer:
            return lambda directory: None
        in_buffers = {b.untyped_storage().data_ptr() for b in module.buffers()}
        weights, optim = staging.copy(
            (module.state_dict(), optimizer.state_dict() if save_optimizer and optimizer is not None else None),
            later=lambda t: t.untyped_storage().data_ptr() not in in_buffers,
        )
        if optimizer is not None:
            staging.guard(optimizer)

        def write(directory: str) -> None:
            staging.wait()
            if staging.error is not None:
                raise CheckpointError(f"The checkpoint in {directory} was not written: {staging.error}.")
            _write_full(directory, weights, optim, safetensors, in_background=True)

        return write

    @classmethod
    def saves_in_background(cls) -> bool:
        return cls.save is FullStateCheckpointIO.save

    def load(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        load_optimizer: bool = True,
    ) -> None:
        if not load_optimizer or optimizer is None:
            return apply_weights(module, load_weights(directory), directory)
        self.load_portable(read_full_files(directory), module=module, optimizer=optimizer, source=directory)

    def load_portable(
        self, state: PortableState, *, module: nn.Module, optimizer: torch.optim.Optimizer | None, source: str
    ) -> None:
        apply_weights(module, state.weights, source)
        if optimizer is None:
            return
        saved = keyed_by_index(state.optimizer, optimizer_names(module, optimizer), source)
        try:
            optimizer.load_state_dict(regroup_optimizer_state(saved, optimizer.param_groups))
        except (ValueError, KeyError) as err:
            raise CheckpointError(
                f"The optimizer state in {source} does not fit this optimizer ({err}); "
                "was optim.name or the set of trainable parameters changed?"
            ) from None


def read_full_files(directory: str) -> PortableState:
    """The weights and `optimizer.pt` of a folder that holds them whole (formats `full` and `fsdp-full`)."""
    path = os.path.join(directory, OPTIMIZER)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: this checkpoint cannot be resumed (saved with save_only_model?).")
    return PortableState(load_weights(directory), safe_torch_load(path))


def _write_full(
    directory: str,
    weights: dict[str, torch.Tensor],
    optim: dict[str, Any] | None,
    safetensors: bool,
    in_background: bool = False,
) -> None:
    """The weights and `optimizer.pt`; `in_background` on the writer thread of an asynchronous save
    (model_weights.save_weights). `torch.save` needs no such care: it writes each storage without the GIL."""
    save_weights(weights, directory, safetensors, in_background=in_background)
    if optim is not None:
        torch.save(optim, os.path.join(directory, OPTIMIZER))
