"""HF's `EarlyStoppingCallback`: stop training once `metric_for_best_model` has failed to improve on
the best value so far for `early_stopping_patience` evaluations in a row.

An evaluation counts as an improvement when it beats `state.best_metric` (in the direction
`greater_is_better` gives) by more than `early_stopping_threshold`. `on_evaluate` runs before the
Trainer records the new best, so each evaluation is compared with the best of the earlier ones.
The patience counter is saved in every checkpoint (HF's `state()` layout) and restored on resume, so
a resumed run stops at the same step as one that never stopped; with
`restore_callback_states_from_checkpoint`, patience and threshold come back from the checkpoint too.

What `metric_for_best_model` and `greater_is_better` mean is defined here once (`best_metric_key`,
`resolve_greater_is_better`) and shared with the Trainer's best-model tracking.
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any

from kiln.engine.callbacks.base import Callback
from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.engine.callbacks.state import TrainerControl, TrainerState

logger = logging.getLogger(__name__)


def _takes_control(method: Any) -> bool:
    """Whether a bound `check_metric_value` has HF's four parameters (or *args), not kiln's earlier three."""
    params = inspect.signature(method).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return True
    return (
        sum(p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params) >= 4
    )


# -- what metric_for_best_model means (shared with the Trainer's best-model tracking) -------------
def best_metric_key(name: str) -> str:
    """`metric_for_best_model` with or without "eval_" -> the key in evaluate()'s metrics."""
    return name if name.startswith("eval_") else f"eval_{name}"


def eval_settings(args: Any) -> Any:
    """Where the evaluation settings are: kiln's `eval` group, or HF's `TrainingArguments` itself, which
    holds `metric_for_best_model` and `greater_is_better` under the same names, flat (a callback written
    for HF calls these methods with its `args`)."""
    return args.eval if hasattr(args, "eval") else args


def resolve_greater_is_better(eval_config: Any) -> bool:
    """HF's default: False for a loss (unset, "loss", "eval_loss", "eval_<dataset>_loss", any name
    ending in "loss", as current Transformers decides), True for every other metric."""
    if eval_config.greater_is_better is not None:
        return bool(eval_config.greater_is_better)
    return not (eval_config.metric_for_best_model or "loss").endswith("loss")


class EarlyStoppingCallback(Callback):
    """Stop when `metric_for_best_model` has not improved for `early_stopping_patience` evaluations.

    Needs `eval.metric_for_best_model` and an `eval.strategy` other than "no". With a dict of eval
    datasets, name the metric with its dataset (`metric_for_best_model: eval_<name>_loss`); the other
    datasets' evaluations are not counted."""

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float | None = 0.0) -> None:
        if early_stopping_patience < 1:
            raise ValueError(f"early_stopping_patience must be >= 1, got {early_stopping_patience}.")
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold or 0.0
        self.early_stopping_patience_counter = 0
        self._warned_missing = False

    def on_train_begin(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        e = eval_settings(config)
        if not e.metric_for_best_model:
            raise KilnError(
                "EarlyStoppingCallback needs eval.metric_for_best_model (metric_for_best_model), "
                "e.g. 'loss' or 'accuracy'."
            )
        if (e.strategy if e is not config else config.eval_strategy) == "no":
            raise KilnError(
                "EarlyStoppingCallback needs evaluation during training: set eval.strategy "
                "(eval_strategy) to 'steps' or 'epoch'."
            )

    def check_metric_value(
        self, config: DictConfig, state: TrainerState, control: TrainerControl, metric_value: float
    ) -> None:
        """Reset the counter on an improvement beyond the threshold, count one more evaluation otherwise.

        HF's signature `(args, state, control, metric_value)`, so a subclass written for HF's callback
        overrides it unchanged, and `args` may be kiln's config or HF's TrainingArguments. (An override with kiln's earlier `(config, state, metric_value)` is still
        called that way: see `on_evaluate`.)"""
        best = state.best_metric
        if best is None:
            improved = True
        else:
            better = metric_value > best if resolve_greater_is_better(eval_settings(config)) else metric_value < best
            improved = better and abs(metric_value - best) > self.early_stopping_threshold
        self.early_stopping_patience_counter = 0 if improved else self.early_stopping_patience_counter + 1

    def on_evaluate(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        key = best_metric_key(eval_settings(config).metric_for_best_model)
        value = (kw.get("metrics") or {}).get(key)
        if value is None:  # e.g. another dataset of an eval dict: not this callback's metric
            if not self._warned_missing:
                logger.warning(
                    "EarlyStoppingCallback: evaluation returned no %r; such evaluations are not counted.", key
                )
                self._warned_missing = True
            return
        if _takes_control(self.check_metric_value):
            self.check_metric_value(config, state, control, float(value))
        else:  # an override written for kiln's earlier signature, without `control`
            self.check_metric_value(config, state, float(value))  # type: ignore[call-arg]
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True

    # -- saved in every checkpoint (HF's ExportableState layout) -----------------------------
    def state(self) -> dict[str, Any]:
        return {
            "args": {
                "early_stopping_patience": self.early_stopping_patience,
                "early_stopping_threshold": self.early_stopping_threshold,
            },
            "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Checkpoints of older kiln versions: the counter from a flat dict (patience stays as configured)."""
        self.early_stopping_patience_counter = int(state.get("early_stopping_patience_counter", 0))
