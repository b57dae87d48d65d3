"""Calling a user's `model_init` the way HF does (with or without the hyperparameter-search trial), inside
a sharding strategy's context where it has one."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from kiln.strategies.interfaces import ShardedModuleInit
from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from torch import nn

    from kiln.strategies.base import Strategy


def build_model(strategy: Strategy, model_init: Callable[..., nn.Module], trial: Any = None) -> nn.Module:
    """`model_init(trial)` (or `model_init()`), inside a sharding strategy's context where it has one."""
    context = strategy.module_init_context() if isinstance(strategy, ShardedModuleInit) else nullcontext()
    with context:
        return call_model_init(model_init, trial)


def call_model_init(model_init: Callable[..., nn.Module], trial: Any = None) -> nn.Module:
    """`model_init()` or `model_init(trial)`, so a trial can change the architecture (HF)."""
    params = list(inspect.signature(model_init).parameters.values())
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) == 1 or (not required and len(params) == 1):
        return model_init(trial)
    if not required:
        return model_init()
    raise KilnError("model_init must take no argument or one (the trial).")
