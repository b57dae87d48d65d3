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
state-dict keys stay the user's. One code path for every strategy: the engine calls the strategy's
`setup_activation_checkpointing` on the module it is about to set up, before the strategy casts, splits
(tensor parallelism), compiles or shards it. Tensor parallelism and `fully_shard` act on the block's
submodules and through module hooks, which `Module.__call__` runs outside the replaced forward, so the
result is torchtitan's order (TP, checkpointing, compile, fully_shard): a recomputed forward runs the
block's split layers and FSDP's hooks stay outside it; per-block compilation wraps the checkpointed forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.config.activation_checkpointing import check
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

    check(mode, every, ops)
    extra: dict[str, Any] = {}
    if mode == "selective":
        extra["context_fn"] = _selective_context(frozenset(resolve_op(n) for n in (ops or DEFAULT_SAVED_OPS)))
    chosen = [block for i, block in enumerate(blocks) if (i + 1) % every == 0]
    for block in chosen:
        if getattr(block, "_kiln_checkpointed", False):  # set up before (a second fit on the same model)
            continue
        block._kiln_checkpointed = True  # type: ignore[assignment]
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **extra, **without_cache(kwargs))

        block.forward = forward
    return chosen


@dataclass(frozen=True)
class Policy:
    """What the config asks for: `mode` (full or selective), `every`, `ops`."""

    mode: str
    every: int = 1
    ops: tuple[str, ...] | None = None


def policy(config: Any, strategy_flag: bool = False) -> Policy | None:
    """The run's checkpointing from the `activation_checkpointing` section; HF's `gradient_checkpointing`
    (and a mesh strategy's own `activation_checkpointing: true`, `strategy_flag`) mean mode full. None: off."""
    if config is None:
        return None
    section = config.activation_checkpointing
    mode = section.mode
    if mode is None and (config.train.gradient_checkpointing or strategy_flag):
        mode = "full"
    if mode is None:
        if section.every != 1 or section.ops is not None:
            raise ConfigError(
                "activation_checkpointing.every / ops are set but activation_checkpointing.mode is not; set mode: "
                "full or selective."
            )
        return None
    ops = tuple(section.ops) if section.ops is not None else None
    return Policy(str(mode), int(section.every), ops)


def _is_hf_layer(module: nn.Module) -> bool:
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)


def find_blocks(
    module: nn.Module, names: list[str] | None = None, min_num_params: int | None = None
) -> list[nn.Module]:
    """The blocks to checkpoint, in model order: FSDP's wrap policy (`names`, `min_num_params`, or the
    model's `_no_split_modules`); when neither is given and the root has no `_no_split_modules` (a
    TrainingModule holding a Transformers model), the innermost model inside that has them, else
    Transformers' own checkpointable layers (GradientCheckpointingLayer)."""
    from kiln.strategies.wrap_policy import blocks_to_wrap

    blocks = blocks_to_wrap(module, names, min_num_params)
    if not blocks and names is None and not min_num_params:
        inner = next((m for m in module.modules() if getattr(m, "_no_split_modules", None)), None)
        blocks = blocks_to_wrap(inner, None, None) if inner is not None else []
        if not blocks:
            blocks = [m for m in module.modules() if _is_hf_layer(m)]
    order = {id(m): i for i, m in enumerate(module.modules())}
    return sorted(blocks, key=lambda m: order[id(m)])


def checkpoint_model(module: nn.Module, chosen: Policy | None, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """Checkpoint `blocks` of `module` as `chosen` says (nothing when it is None); returns the checkpointed blocks."""
    if chosen is None:
        return []
    if not blocks:
        raise ConfigError(
            f"activation_checkpointing has no blocks to checkpoint in {type(module).__name__}: give the model "
            "class a _no_split_modules list naming its repeated block classes (as Transformers models have), or "
            "name them with strategy.wrap under fsdp / model_parallel."
        )
    return apply_activation_checkpointing(blocks, chosen.mode, chosen.every, chosen.ops)
