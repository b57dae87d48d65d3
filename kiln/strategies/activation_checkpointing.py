"""Activation checkpointing of a model's repeated blocks, full or selective (torchtitan's policies).

- `full`: a checkpointed block keeps only its inputs; backward runs its forward again.
- `selective`: a checkpointed block keeps the outputs of the expensive ops (`ops`; by default
  torchtitan's list: matmuls, attention, max, and the float8 matmul) and recomputes the cheap ones
  (norms, activations, adds). As torchtitan does, every second matmul is recomputed anyway, which halves
  what the matmuls keep for one more matmul in backward.
- `every: N` checkpoints blocks N, 2N, ... (1-based) and leaves the others alone (torchtitan's per-layer
  option), trading memory for speed in steps of one block.

Checkpointing changes which activations live, never a value: gradients equal the un-checkpointed run's.
The forward is replaced on the instance (non-reentrant torch.utils.checkpoint), so parameter names and
state-dict keys stay the user's. Strategies apply it after tensor parallelism and before compilation and
`fully_shard` (torchtitan's order), so a recomputed forward runs the block's split layers and FSDP's
hooks stay outside it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from kiln.utils.errors import ConfigError

#: torchtitan's save list, with the CPU and cuDNN attention kernels of the same op
DEFAULT_SAVED_OPS = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_mm.default",
    "aten.max.default",
)
MODES = ("full", "selective")


def resolve_op(name: str) -> Any:
    """`aten.mm.default` (or `aten.mm`, the default overload) -> torch.ops.aten.mm.default."""
    parts = name.split(".")
    if len(parts) == 2:
        parts.append("default")
    target: Any = torch.ops
    try:
        for part in parts:
            target = getattr(target, part)
    except (AttributeError, RuntimeError):
        raise ConfigError(
            f"activation_checkpointing.ops names {name!r}, which is not a torch operator; write it as "
            "aten.<op>[.<overload>], e.g. aten.mm or aten._scaled_dot_product_flash_attention"
        ) from None
    return target


def _selective_context(saved: frozenset[Any]) -> Callable[[], Any]:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    mm = torch.ops.aten.mm.default

    def contexts() -> Any:
        counts = {"forward": 0, "recompute": 0}  # a fresh count per call: forward and recompute agree

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            if func is mm:
                counts["recompute" if ctx.is_recompute else "forward"] += 1
            count = counts["recompute" if ctx.is_recompute else "forward"]
            keep = func in saved and not (func is mm and count % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return contexts


#: the names Transformers layers take a KV cache by
CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


def without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A block's keyword arguments without a KV cache. Transformers models build one even in training unless
    their own gradient checkpointing is on, and a layer writes into it: the recomputed forward would then
    attend over its own keys twice (a silently different gradient, or selective checkpointing's "not found
    in storage"). Training never reads the cache, so it is dropped, as Transformers' checkpointing does."""
    if not any(kwargs.get(name) is not None for name in CACHE_KWARGS) and not kwargs.get("use_cache"):
        return kwargs
    kwargs = {**kwargs, **{name: None for name in CACHE_KWARGS if kwargs.get(name) is not None}}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return kwargs


def apply_activation_checkpointing(
    blocks: Sequence[nn.Module], mode: str = "full", every: int = 1, ops: Sequence[str] | None = None
) -> list[nn.Module]:
    """Checkpoint blocks `every`, 2x`every`, ... of `blocks` in `mode`; returns the checkpointed blocks."""
    from torch.utils.checkpoint import checkpoint

    if mode not in MODES:
        raise ConfigError(f"activation_checkpointing.mode is {mode!r}; use full or selective.")
    if every < 1:
        raise ConfigError(f"activation_checkpointing.every is {every}; use 1 for every block, N for every N-th.")
    if ops is not None and mode != "selective":
        raise ConfigError(
            "activation_checkpointing.ops chooses what selective checkpointing keeps; set mode: selective "
            "or remove ops."
        )
    extra: dict[str, Any] = {}
    if mode == "selective":
        extra["context_fn"] = _selective_context(frozenset(resolve_op(n) for n in (ops or DEFAULT_SAVED_OPS)))
    chosen = [block for i, block in enumerate(blocks) if (i + 1) % every == 0]
    for block in chosen:
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **extra, **without_cache(kwargs))

        block.forward = forward
    return chosen
