"""The model a Trainer trains (`trainer_model`), and calling a user's `model_init` the way HF does (with or
without the hyperparameter-search trial), inside a sharding strategy's context where it has one."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from torch import nn

from kiln.strategies.interfaces import ShardedModuleInit
from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from kiln.strategies.base import Strategy


def build_model(strategy: Strategy, model_init: Callable[..., nn.Module], trial: Any = None) -> nn.Module:
    """`model_init(trial)` (or `model_init()`), inside a sharding strategy's context where it has one."""
    context = strategy.module_init_context() if isinstance(strategy, ShardedModuleInit) else nullcontext()
    with context:
        return call_model_init(model_init, trial)


def trainer_model(
    strategy: Strategy, config: Any, model: nn.Module | None, model_init: Callable[..., nn.Module] | None, trial: Any
) -> nn.Module:
    """The model a Trainer trains: `model` as given, or `model_init(trial)` without one, and always for a search
    trial (a fresh model per trial, as in HF); with the config's `train.use_cache` on an HF model's config."""
    if model is None or trial is not None:
        if model_init is None:
            raise KilnError("Trainer needs a model: pass `model=` or `model_init=` (a callable returning the model).")
        model = build_model(strategy, model_init, trial)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"`model` must be a torch.nn.Module (a TrainingModule or an HF-contract model), not {type(model).__name__}."
        )
    if config.train.use_cache is not None and getattr(model, "config", None) is not None:
        hf: Any = model  # an HF model's config (nn.Module.__getattr__ would type it Tensor | Module)
        hf.config.use_cache = config.train.use_cache  # HF sets it from TrainingArguments.use_cache
    return model


def call_model_init(model_init: Callable[..., nn.Module], trial: Any = None) -> nn.Module:
    """`model_init()` or `model_init(trial)`, so a trial can change the architecture (HF)."""
    params = list(inspect.signature(model_init).parameters.values())
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) == 1 or (not required and len(params) == 1):
        return model_init(trial)
    if not required:
        return model_init()
    raise KilnError("model_init must take no argument or one (the trial).")
