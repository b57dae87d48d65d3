"""Evaluation during `fit()`: what the fit loop does around the Trainer's `evaluate` at an eval step (the
best metric, `save_strategy: best`, a metric-driven scheduler, the hyperparameter-search trial), and the
check before training that there is something to evaluate on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.engine.checkpoint.best_model import metric_key, update_best
from kiln.engine.data.checks import check_eval_dataset
from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.hooks import TrainerHooks
    from kiln.engine.run import Run


def evaluate_during_training(
    hooks: TrainerHooks, run: Run, config: Any, ignore_keys: list[str] | None, on_start: bool = False
) -> dict[str, float]:
    """Evaluate, then update the best metric, `save_strategy: best` and a metric-driven scheduler.
    The sanity evaluation of `eval_on_start` does neither (HF)."""
    metrics = hooks.evaluate(ignore_keys=ignore_keys)
    if on_start:
        return metrics
    hooks._report_to_trial(metrics)  # hyperparameter_search: the objective so far, and pruning
    improved = update_best(run.state, config, metrics)
    if config.save.strategy == "best":
        run.control.should_save = improved
    if run.scheduler_needs_metrics and run.scheduler is not None:
        run.scheduler.step(metrics[metric_key(config, metrics)])
    return metrics


def check_eval_setup(config: Any, eval_dataset: Any, custom_loader: bool) -> None:
    """Before training: evaluation during training needs something to evaluate on (HF fails at init).
    `custom_loader`: the Trainer's `get_eval_dataloader` is overridden, and finds its own data."""
    e = config.eval
    if (e.strategy != "no" or e.on_start) and eval_dataset is None and not custom_loader:
        raise KilnError(
            f"eval.strategy is {e.strategy!r}{' with eval_on_start' if e.on_start else ''} but the Trainer "
            "has no eval_dataset: pass eval_dataset=... or set eval_strategy='no'."
        )
    if (e.strategy != "no" or e.on_start) and not custom_loader:
        named = eval_dataset.items() if isinstance(eval_dataset, Mapping) else [(None, eval_dataset)]
        for name, dataset in named:
            check_eval_dataset(
                dataset,
                "eval_dataset" + (f" {name!r}" if name is not None else ""),
                "pass a dataset with items, or set eval_strategy='no'",
            )
