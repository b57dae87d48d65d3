"""`activation_checkpointing: true`: each wrapped block's activations are recomputed in backward
instead of kept, under both presets of the mesh strategy. Applied after tensor parallelism and before
compilation and `fully_shard` (torchtitan's order: TP, activation checkpointing, compile, FSDP), so the
recomputed forward runs the block's TP-split layers and FSDP's hooks stay outside it."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


def apply_activation_checkpointing(blocks: list[nn.Module]) -> None:
    """Recompute each block's forward in backward (non-reentrant torch.utils.checkpoint). The forward
    is replaced on the instance, so parameter names stay what the user's module calls them."""
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
