"""Compiling a model's repeated blocks one by one (regional compilation): `torch_compile: {regions: blocks}`
on every strategy, and FSDP2's per-block compile under `train.torch_compile*`.

Each block's `forward` is compiled in place. The blocks run the same code on parameters of the same shapes,
so dynamo compiles the first block's graph and replays it for every other block (0 recompiles across
layers): the compile time is one block's, not the whole model's, as accelerate's `compile_regions` and
torchtitan's per-block compile give. What lies between the blocks (embeddings, final norm, head, loss) runs
eagerly: compiling those modules as regions of their own, as accelerate's `compile_regions` does with every
leaf outside the repeated blocks, was measured (bench/regional_paired.py) to recover at most a few points,
within the noise, of the steady-state cost against whole-model compile (each is one operator that inductor
cannot make cheaper alone), and the loss, where fusion would pay, is computed inside the model's own forward.

torchtitan swaps each block for its `torch.compile` wrapper, which puts `_orig_mod.` into every parameter
name below it; kiln compiles the block's `forward` in place instead, so checkpoints and exports keep the
model's own names. Wrappers' hooks (FSDP's all-gather and reshard, DDP's, DeepSpeed's) sit in
`Module.__call__`, outside that forward, so they run eagerly around the compiled graph: under FSDP2 this is
what keeps dynamo from tracing into FSDP's hooks (`skip_fsdp_hooks`, a graph break around every unit), which
compiling the whole sharded module would do.

Order (torchtitan's): tensor parallelism, activation checkpointing (the compiled forward wraps the
checkpointed one), compile, then the strategy's wrapping or sharding."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.config.compile import compiles_blocks, model_compile_kwargs
from kiln.utils.errors import ConfigError


def compile_units(units: list[nn.Module], config: Any) -> int:
    """Compile each unit's forward in place when the config asks (returns how many were compiled).
    Called before the strategy wraps or shards them, so the units still have their own classes and forwards."""
    kwargs = model_compile_kwargs(config)
    if kwargs is None:
        return 0
    count = 0
    for unit in units:
        if hasattr(unit.forward, "_torchdynamo_orig_callable"):  # set up before (a second fit): compiled already
            continue
        # an instance attribute: `Module.__call__` runs the wrapper's hooks, then this compiled forward
        unit.forward = torch.compile(unit.forward, **kwargs)
        count += 1
    return count


def compile_blocks(module: nn.Module, config: Any, blocks: list[nn.Module]) -> int:
    """`torch_compile: {regions: blocks}`: compile `blocks` (the strategy's block finder's) of `module`;
    nothing when the config does not ask. Without blocks there is no region to compile: refused in one
    sentence rather than silently compiling the whole model."""
    if not compiles_blocks(config):
        return 0
    if not blocks:
        raise ConfigError(
            f"torch_compile.regions: blocks found no repeated blocks in {type(module).__name__}: give the model "
            "class a _no_split_modules list naming its block classes (as Transformers models have), name them with "
            "strategy.wrap under fsdp / model_parallel, or unset torch_compile.regions to compile the whole model."
        )
    return compile_units(blocks, config)
