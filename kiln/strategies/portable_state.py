"""A checkpoint's model and optimizer state in the one form every translatable format reads and loads:
full tensors keyed as the user's module names them. It is what lets a checkpoint of one format resume under
a strategy that writes another (kiln.strategies.format_translation): a `full` (single, DDP) checkpoint under
FSDP, a sharded DCP one on a single process, and so on.

The optimizer state stays an `Optimizer.state_dict()`; only how its per-parameter state is keyed differs
between formats: torch's own state dict keys it by the parameter's flat index in the optimizer's param
groups (`full`), DCP's by the parameter's name (`fsdp-full`, `fsdp-sharded`). The running optimizer's
parameters, named through the module, translate one keying into the other: a checkpoint and a run of one
model list the parameters in the same flat order, whichever param-group layout (kiln.utils.param_groups)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.utils.errors import CheckpointError


@dataclass
class PortableState:
    """`weights`: the full model state dict; `optimizer`: an `Optimizer.state_dict()` keyed by flat index
    or by parameter name."""

    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]


def optimizer_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each of the optimizer's parameters, in its flat order across param groups."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _flat(saved: dict[str, Any]) -> list[Any]:
    return [p for group in saved["param_groups"] for p in group["params"]]


def _rekeyed(saved: dict[str, Any], key: dict[Any, Any]) -> dict[str, Any]:
    groups = [{**group, "params": [key[p] for p in group["params"]]} for group in saved["param_groups"]]
    return {**saved, "state": {key[p]: v for p, v in saved["state"].items()}, "param_groups": groups}


def keyed_by_name(saved: dict[str, Any], names: list[str], source: str) -> dict[str, Any]:
    """`saved` with its per-parameter state keyed by name (`names`: the running optimizer's, flat order)."""
    flat = _flat(saved)
    if all(isinstance(p, str) for p in flat):
        return saved
    if len(flat) != len(names):
        raise CheckpointError(
            f"The optimizer state in {source} holds {len(flat)} parameters and this run's optimizer has "
            f"{len(names)}; was the set of trainable parameters changed?"
        )
    return _rekeyed(saved, dict(zip(flat, names)))


def keyed_by_index(saved: dict[str, Any], names: list[str], source: str) -> dict[str, Any]:
    """`saved` with its per-parameter state keyed by flat index, as torch's `Optimizer.load_state_dict` reads it."""
    flat = _flat(saved)
    if not all(isinstance(p, str) for p in flat):
        return saved
    index = {name: i for i, name in enumerate(names)}
    if unknown := sorted(set(flat) - set(index)):
        raise CheckpointError(
            f"The optimizer state in {source} is for parameters this run's optimizer does not have "
            f"({', '.join(unknown[:8])}); was the model or the set of trainable parameters changed?"
        )
    return _rekeyed(saved, index)
