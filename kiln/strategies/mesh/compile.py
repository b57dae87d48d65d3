"""`train.torch_compile*` under FSDP2: each block is compiled on its own before it is sharded, as
torchtitan does (activation checkpointing, then compile, then `fully_shard`).

Compiling the whole sharded module would trace into FSDP's pre/post-forward hooks (all-gather,
reshard), which dynamo does not trace (`skip_fsdp_hooks`): a graph break around every unit. Per
block, the hooks run eagerly around the compiled forward and the repeated blocks share one graph.

torchtitan swaps each block for its `torch.compile` wrapper, which puts `_orig_mod.` into every
parameter name below it; kiln compiles the block's `forward` in place instead, so checkpoints and
exports keep the model's own names. The FSDP hooks sit in `Module.__call__`, outside that forward,
exactly where they sit around torchtitan's wrapper."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.config.compile import model_compile_kwargs


def compile_units(units: list[nn.Module], train: Any) -> int:
    """Compile each unit's forward in place when the config asks (returns how many were compiled).
    Called before `fully_shard`, so the units still have their own classes and forwards."""
    kwargs = model_compile_kwargs(train)
    if kwargs is None:
        return 0
    count = 0
    for unit in units:
        if hasattr(unit.forward, "_torchdynamo_orig_callable"):  # set up before (a second fit): compiled already
            continue
        # an instance attribute: `Module.__call__` runs the (FSDP) hooks, then this compiled forward
        unit.forward = torch.compile(unit.forward, **kwargs)
        count += 1
    return count
