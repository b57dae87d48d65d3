"""Evaluation during training: best-metric tracking (`metric_for_best_model`, `greater_is_better`),
`save_strategy: best`, metric-driven schedulers and `load_best_model_at_end`."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kiln.engine.callbacks.early_stopping import best_metric_key, resolve_greater_is_better
from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.protocols import TrainerLike

logger = logging.getLogger("kiln.engine.trainer_eval")


class BestModelMixin:
    """Mixed into Trainer (through EvaluationMixin); `self` is the Trainer."""

    def evaluate_during_training(self: "TrainerLike", on_start: bool = False) -> dict[str, float]:
        """Evaluate, then update the best metric, `save_strategy: best` and a metric-driven scheduler.
        The sanity evaluation of `eval_on_start` does neither (HF)."""
        metrics = self.evaluate(ignore_keys=getattr(self, "_ignore_keys_for_eval", None))
        if on_start:
            return metrics
        self._report_to_trial(metrics)  # hyperparameter_search: the objective so far, and pruning
        improved = self._update_best(metrics)
        if self.config.save.strategy == "best":
            self.control.should_save = improved
        if self.scheduler_needs_metrics and self.lr_scheduler is not None:
            self.lr_scheduler.step(metrics[self._best_metric_key(metrics)])
        return metrics

    def _best_metric_key(self: "TrainerLike", metrics: Mapping[str, float]) -> str:
        name = self.config.eval.metric_for_best_model or "loss"
        key = best_metric_key(name)
        if key not in metrics:
            raise KilnError(f"metric_for_best_model is {name!r} but evaluation returned no {key!r} "
                            f"(it returned: {', '.join(sorted(metrics))}).")
        return key

    def greater_is_better(self: "TrainerLike") -> bool:
        return resolve_greater_is_better(self.config.eval)

    def _update_best(self: "TrainerLike", metrics: Mapping[str, float]) -> bool:
        e = self.config.eval
        if not (e.metric_for_best_model or e.load_best_model_at_end or self.config.save.strategy == "best"):
            return False
        value = float(metrics[self._best_metric_key(metrics)])
        best = self.state.best_metric
        better = best is None or (value > best if self.greater_is_better() else value < best)
        if better:
            self.state.best_metric, self.state.best_global_step = value, self.state.global_step
        return better

    def _load_best_model(self: "TrainerLike") -> None:
        path = self.state.best_model_checkpoint
        if not path or not os.path.isdir(path):
            logger.warning("load_best_model_at_end: no best checkpoint was saved; keeping the last weights.")
            return
        from kiln.engine.checkpoint.weights import load_weights_for_eval

        load_weights_for_eval(self, path)
