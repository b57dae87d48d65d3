"""Checkpoints of `strategy: xla` (format "xla-full"): the layout of single/DDP checkpoints
(model.safetensors + optimizer.pt), written from CPU copies of the XLA tensors.

XLA tensors have no host storage, so they are copied to the CPU first (one device->host transfer per
save); tied parameters are copied once, so the safetensors writer still stores them once. Loading
needs nothing special: `load_state_dict` copies CPU tensors into the XLA parameters, and the
optimizer moves its loaded state to its parameters' device."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from kiln.strategies.checkpoint_io import register_format
from kiln.strategies.full_checkpoint_io import OPTIMIZER, FullStateCheckpointIO
from kiln.strategies.model_weights import save_weights


def to_cpu(tree: Any, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """`tree` with every tensor copied to the CPU; one tensor object reached twice (tied weights)
    becomes one CPU tensor."""
    memo = {} if memo is None else memo
    if isinstance(tree, torch.Tensor):
        if id(tree) not in memo:
            memo[id(tree)] = tree.detach().to("cpu")
        return memo[id(tree)]
    if isinstance(tree, dict):
        return (
            type(tree)((k, to_cpu(v, memo)) for k, v in tree.items())
            if type(tree) is not dict
            else {k: to_cpu(v, memo) for k, v in tree.items()}
        )
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v, memo) for v in tree)
    return tree


def module_state_cpu(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict on the CPU, tied parameters sharing one tensor (keep_vars=True hands
    back the Parameter objects themselves, so a tie is one object under two names)."""
    return to_cpu(module.state_dict(keep_vars=True))


@register_format
class XLACheckpointIO(FullStateCheckpointIO):
    format = "xla-full"
    translatable = False  # its tensors live on the XLA device: no translation written or tested for it yet
    reshardable = True

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
        weights = module_state_cpu(module)
        optim = to_cpu(optimizer.state_dict()) if save_optimizer and optimizer is not None else None
        if not writer:
            return
        save_weights(weights, directory, safetensors)
        if optim is not None:
            torch.save(optim, os.path.join(directory, OPTIMIZER))
