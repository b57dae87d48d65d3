"""Best-metric tracking (`metric_for_best_model`, `greater_is_better`) behind `save_strategy: best`,
metric-driven schedulers and `load_best_model_at_end`: which metric, which direction, and whether an
evaluation improved on the best so far (recorded in the TrainerState, as HF does)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kiln.engine.callbacks.early_stopping import best_metric_key, resolve_greater_is_better
from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.callbacks.state import TrainerState

logger = logging.getLogger(__name__)


def metric_key(config: Any, metrics: Mapping[str, float]) -> str:
    """The key of `metric_for_best_model` (default: the loss) in `metrics`; an error naming what is there."""
    name = config.eval.metric_for_best_model or "loss"
    key = best_metric_key(name)
    if key not in metrics:
        raise KilnError(
            f"metric_for_best_model is {name!r} but evaluation returned no {key!r} "
            f"(it returned: {', '.join(sorted(metrics))})."
        )
    return key


def update_best(state: TrainerState, config: Any, metrics: Mapping[str, float]) -> bool:
    """Record `metrics` as the best so far when they are (and the run tracks a best model at all);
    returns whether they improved on it."""
    e = config.eval
    if not (e.metric_for_best_model or e.load_best_model_at_end or config.save.strategy == "best"):
        return False
    value = float(metrics[metric_key(config, metrics)])
    best = state.best_metric
    better = best is None or (value > best if resolve_greater_is_better(e) else value < best)
    if better:
        state.best_metric, state.best_global_step = value, state.global_step
    return better


def load_best_model(state: TrainerState, load: Callable[[str], None]) -> None:
    """`load_best_model_at_end`: `load(path)` (the Trainer's `_load_from_checkpoint`) of the best checkpoint
    the state records, or a warning when none was saved (the last weights stay)."""
    path = state.best_model_checkpoint
    if not path or not os.path.isdir(path):
        logger.warning("load_best_model_at_end: no best checkpoint was saved; keeping the last weights.")
        return
    load(path)
