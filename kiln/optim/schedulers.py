"""Learning-rate schedules picked by Hugging Face `lr_scheduler_type` name.

The formulas are transformers.optimization's, rewritten so that kiln does not need transformers and
checked step for step against it in tests/engine/test_schedulers.py: an HF user's schedule gives the
same learning rates here. Each registry entry is a factory `(optimizer, num_warmup_steps,
num_training_steps, **kwargs) -> scheduler` whose keyword arguments are exactly what `scheduler.kwargs`
(HF's `lr_scheduler_kwargs`) may hold, so a typo fails before training. LambdaLR factors are partials of
module-level functions, so scheduler state_dicts hold only numbers (`torch.load(weights_only=True)`).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from functools import partial
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from kiln.optim.greedy_lr import GreedyLR
from kiln.registry import Registry, publish

logger = logging.getLogger(__name__)

SchedulerFactory = Callable[..., Any]
SCHEDULERS: Registry[SchedulerFactory] = publish(Registry("lr scheduler", "scheduler.name"))
_POSITIONAL, _SHAPES = ("optimizer", "num_warmup_steps", "num_training_steps"), ("linear", "cosine", "1-sqrt")


# ----------------------------------------------------------------------------- LambdaLR factors (HF formulas)


def _warmup(step: int, num_warmup_steps: int) -> float:
    return float(step) / float(max(1, num_warmup_steps))


def _constant(step: int, *, num_warmup_steps: int = 0) -> float:
    return _warmup(step, num_warmup_steps) if step < num_warmup_steps else 1.0


def _linear(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))


def _cosine(
    step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float, min_lr_rate: float
) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return max(0, factor * (1 - min_lr_rate) + min_lr_rate)


def _cosine_restarts(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(num_cycles) * progress) % 1.0))))


def _polynomial(
    step: int, *, num_warmup_steps: int, num_training_steps: int, lr_end: float, power: float, lr_init: float
) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    if step > num_training_steps:
        return lr_end / lr_init  # LambdaLR multiplies by lr_init
    pct_remaining = 1 - (step - num_warmup_steps) / (num_training_steps - num_warmup_steps)
    return ((lr_init - lr_end) * pct_remaining**power + lr_end) / lr_init


def _inverse_sqrt(step: int, *, num_warmup_steps: int, timescale: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    shift = timescale - num_warmup_steps
    return 1.0 / math.sqrt((step + shift) / timescale)


def _cosine_warmup_min_lr(
    step: int,
    *,
    num_warmup_steps: int,
    num_training_steps: int,
    num_cycles: float,
    min_lr_rate: float,
    warmup_lr_rate: float | None,
) -> float:
    """HF's cosine_warmup_with_min_lr: the warmup starts above 0 and the decay is shifted by one step."""
    cur, warm, total = float(step), float(num_warmup_steps), float(num_training_steps)
    if cur < warm:
        if warmup_lr_rate is None:
            return (cur + 1.0) / max(1.0, warm)
        rate = float(warmup_lr_rate)
        return rate + (1.0 - rate) * cur / max(1, warm - 1)
    progress = (cur - warm + 1.0) / max(1.0, total - warm)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0, factor * (1 - min_lr_rate) + min_lr_rate)


def _wsd(
    step: int,
    *,
    num_warmup_steps: int,
    num_stable_steps: int,
    num_decay_steps: int,
    warmup_type: str,
    decay_type: str,
    min_lr_ratio: float,
    num_cycles: float,
) -> float:
    if step < num_warmup_steps:
        progress = float(step) / float(max(1, num_warmup_steps))
        if warmup_type == "linear":
            factor = progress
        elif warmup_type == "cosine":
            factor = 0.5 * (1.0 - math.cos(math.pi * progress))
        else:
            factor = 1.0 - math.sqrt(1.0 - progress)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < num_warmup_steps + num_stable_steps:
        return 1.0
    if step < num_warmup_steps + num_stable_steps + num_decay_steps:
        progress = float(step - num_warmup_steps - num_stable_steps) / float(max(1, num_decay_steps))
        if decay_type == "linear":
            factor = 1.0 - progress
        elif decay_type == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
        else:
            factor = 1.0 - math.sqrt(progress)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


# ----------------------------------------------------------------------------- registry entries


def _min_lr_rate(name: str, optimizer: Optimizer, min_lr: float | None, min_lr_rate: float | None) -> float:
    if (min_lr is None) == (min_lr_rate is None):
        raise ValueError(
            f"lr scheduler {name!r} needs one of `scheduler.kwargs.min_lr` or `scheduler.kwargs.min_lr_rate`."
        )
    return min_lr / optimizer.defaults["lr"] if min_lr is not None else min_lr_rate  # type: ignore[return-value]


@SCHEDULERS.register("constant")
def _sched_constant(optimizer: Optimizer, num_warmup_steps: int, num_training_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, _constant)


@SCHEDULERS.register("constant_with_warmup")
def _sched_constant_warmup(optimizer: Optimizer, num_warmup_steps: int, num_training_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, partial(_constant, num_warmup_steps=num_warmup_steps))


@SCHEDULERS.register("linear")
def _sched_linear(optimizer: Optimizer, num_warmup_steps: int, num_training_steps: int) -> LambdaLR:
    return LambdaLR(
        optimizer, partial(_linear, num_warmup_steps=num_warmup_steps, num_training_steps=num_training_steps)
    )


@SCHEDULERS.register("cosine")
def _sched_cosine(
    optimizer: Optimizer, num_warmup_steps: int, num_training_steps: int, *, num_cycles: float = 0.5
) -> LambdaLR:
    return LambdaLR(
        optimizer,
        partial(
            _cosine,
            num_warmup_steps=num_warmup_steps,
            num_training_steps=num_training_steps,
            num_cycles=num_cycles,
            min_lr_rate=0.0,
        ),
    )


@SCHEDULERS.register("cosine_with_restarts")
def _sched_restarts(
    optimizer: Optimizer, num_warmup_steps: int, num_training_steps: int, *, num_cycles: int = 1
) -> LambdaLR:
    return LambdaLR(
        optimizer,
        partial(
            _cosine_restarts,
            num_warmup_steps=num_warmup_steps,
            num_training_steps=num_training_steps,
            num_cycles=num_cycles,
        ),
    )


@SCHEDULERS.register("polynomial")
def _sched_polynomial(
    optimizer: Optimizer, num_warmup_steps: int, num_training_steps: int, *, lr_end: float = 1e-7, power: float = 1.0
) -> LambdaLR:
    lr_init = optimizer.defaults["lr"]
    if not lr_init > lr_end:
        raise ValueError(f"`scheduler.kwargs.lr_end` ({lr_end}) must be smaller than the initial lr ({lr_init}).")
    return LambdaLR(
        optimizer,
        partial(
            _polynomial,
            num_warmup_steps=num_warmup_steps,
            num_training_steps=num_training_steps,
            lr_end=lr_end,
            power=power,
            lr_init=lr_init,
        ),
    )


@SCHEDULERS.register("inverse_sqrt")
def _sched_inverse_sqrt(
    optimizer: Optimizer, num_warmup_steps: int, num_training_steps: int, *, timescale: int | None = None
) -> LambdaLR:
    timescale = timescale if timescale is not None else (num_warmup_steps or 10_000)
    return LambdaLR(optimizer, partial(_inverse_sqrt, num_warmup_steps=num_warmup_steps, timescale=timescale))


@SCHEDULERS.register("cosine_with_min_lr")
def _sched_cosine_min_lr(
    optimizer: Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    *,
    num_cycles: float = 0.5,
    min_lr: float | None = None,
    min_lr_rate: float | None = None,
) -> LambdaLR:
    rate = _min_lr_rate("cosine_with_min_lr", optimizer, min_lr, min_lr_rate)
    return LambdaLR(
        optimizer,
        partial(
            _cosine,
            num_warmup_steps=num_warmup_steps,
            num_training_steps=num_training_steps,
            num_cycles=num_cycles,
            min_lr_rate=rate,
        ),
    )


@SCHEDULERS.register("cosine_warmup_with_min_lr")
def _sched_cosine_warmup_min_lr(
    optimizer: Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    *,
    num_cycles: float = 0.5,
    min_lr: float | None = None,
    min_lr_rate: float | None = None,
    warmup_lr_rate: float | None = None,
) -> LambdaLR:
    rate = _min_lr_rate("cosine_warmup_with_min_lr", optimizer, min_lr, min_lr_rate)
    return LambdaLR(
        optimizer,
        partial(
            _cosine_warmup_min_lr,
            num_warmup_steps=num_warmup_steps,
            num_cycles=num_cycles,
            num_training_steps=num_training_steps,
            min_lr_rate=rate,
            warmup_lr_rate=warmup_lr_rate,
        ),
    )


@SCHEDULERS.register("warmup_stable_decay")
def _sched_wsd(
    optimizer: Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    *,
    num_decay_steps: int | None = None,
    num_stable_steps: int | None = None,
    warmup_type: str = "linear",
    decay_type: str = "cosine",
    min_lr_ratio: float = 0,
    num_cycles: float = 0.5,
) -> LambdaLR:
    """Warmup, then constant, then decay; `num_stable_steps` defaults to the steps the other two leave."""
    if num_decay_steps is None:
        raise ValueError("lr scheduler 'warmup_stable_decay' needs `scheduler.kwargs.num_decay_steps`.")
    for key, shape in (("warmup_type", warmup_type), ("decay_type", decay_type)):
        if shape not in _SHAPES:
            raise ValueError(f"`scheduler.kwargs.{key}` must be one of {', '.join(_SHAPES)}, got {shape!r}.")
    if num_stable_steps is None:
        num_stable_steps = num_training_steps - num_warmup_steps - num_decay_steps
    return LambdaLR(
        optimizer,
        partial(
            _wsd,
            num_warmup_steps=num_warmup_steps,
            num_stable_steps=num_stable_steps,
            num_decay_steps=num_decay_steps,
            warmup_type=warmup_type,
            decay_type=decay_type,
            min_lr_ratio=min_lr_ratio,
            num_cycles=num_cycles,
        ),
    )


@SCHEDULERS.register("reduce_lr_on_plateau")
def _sched_plateau(
    optimizer: Optimizer, num_warmup_steps: int, num_training_steps: int, **kwargs: Any
) -> ReduceLROnPlateau:
    """torch's ReduceLROnPlateau; the loop steps it with the eval metric after each evaluation."""
    _check_kwargs("reduce_lr_on_plateau", kwargs, ReduceLROnPlateau)
    return ReduceLROnPlateau(optimizer, **kwargs)


@SCHEDULERS.register("greedy")
def _sched_greedy(optimizer: Optimizer, num_warmup_steps: int, num_training_steps: int, **kwargs: Any) -> GreedyLR:
    """HF's GreedyLR; stepped with the eval metric like ReduceLROnPlateau."""
    _check_kwargs("greedy", kwargs, GreedyLR)
    return GreedyLR(optimizer, **kwargs)


# ----------------------------------------------------------------------------- public API


def _check_kwargs(name: str, kwargs: dict[str, Any], target: Callable[..., Any]) -> None:
    """Fail on a `scheduler.kwargs` key that `target` does not take, listing the ones it does."""
    params = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return  # the factory checks against the class it builds
    accepted = [k for k in params if k not in _POSITIONAL and k != "self"]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(
            f"Unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} in `scheduler.kwargs` "
            f"for lr scheduler {name!r}; it accepts: {', '.join(accepted) or 'no arguments'}."
        )


def get_scheduler(
    name: str, optimizer: Optimizer, num_warmup_steps: int, num_training_steps: int, **kwargs: Any
) -> LRScheduler | GreedyLR:
    """The schedule named `name` (HF's `lr_scheduler_type`), with HF's `lr_scheduler_kwargs` as kwargs."""
    name = str(getattr(name, "value", name))  # also accepts HF's SchedulerType enum
    factory = SCHEDULERS.get(name)
    _check_kwargs(name, kwargs, factory)
    return factory(optimizer, num_warmup_steps, num_training_steps, **kwargs)


def warmup_steps_for(sched_cfg: Any, num_training_steps: int) -> int:
    """HF's get_warmup_steps: `warmup_steps` when > 0, else ceil(warmup_ratio * num_training_steps)."""
    steps = int(_field(sched_cfg, "warmup_steps", 0) or 0)
    return steps if steps > 0 else math.ceil(float(_field(sched_cfg, "warmup_ratio", 0.0) or 0.0) * num_training_steps)


def build_scheduler(optimizer: Optimizer, sched_cfg: Any, num_training_steps: int) -> LRScheduler | GreedyLR:
    """The schedule the `scheduler` config group (SchedulerConfig, DictConfig or mapping) asks for."""
    kwargs = _field(sched_cfg, "kwargs", None) or {}
    from omegaconf import OmegaConf  # lazy: importing kiln must not pay for omegaconf

    if OmegaConf.is_config(kwargs):  # hand the schedule plain Python values (lists, not ListConfig)
        kwargs = OmegaConf.to_container(kwargs, resolve=True)
    name, warmup = str(_field(sched_cfg, "name", "linear")), warmup_steps_for(sched_cfg, num_training_steps)
    if warmup > 0 and name.lower() in ("constant", "reduce_lr_on_plateau", "greedy"):
        logger.warning(
            "lr scheduler %r has no warmup; ignoring %d warmup steps (use constant_with_warmup?).", name, warmup
        )
    return get_scheduler(name, optimizer, warmup, num_training_steps, **dict(kwargs))


def scheduler_needs_metrics(scheduler: Any) -> bool:
    """True when the loop must step `scheduler` with the eval metric after evaluating, not every step:
    whatever its class (torch's ReduceLROnPlateau, Transformers' GreedyLR, a user's own), a `step` whose
    first argument has no default takes the metric."""
    if scheduler is None:
        return False
    if isinstance(scheduler, (ReduceLROnPlateau, GreedyLR)):
        return True
    try:
        params = list(inspect.signature(scheduler.step).parameters.values())
    except (AttributeError, TypeError, ValueError):
        return False
    return (
        bool(params)
        and params[0].default is params[0].empty
        and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    )


def _field(cfg: Any, key: str, default: Any) -> Any:
    return cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
