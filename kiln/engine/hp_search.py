"""`Trainer.hyperparameter_search` (HF), which delegates to `HyperparameterSearch`: with Optuna, every
trial trains a Trainer of its own, built through the searching Trainer's constructor
(`type(trainer)(*the same arguments)`, so a subclass's `__init__` runs for each trial), with the
trial's hyperparameters applied to the config, its files in `output_dir/run-<n>` and a fresh model
from `model_init(trial)`; it is scored by `compute_objective` on its evaluation metrics. Evaluations
during training report to the trial, so Optuna's pruners can stop a poor trial early (single objective
only, as in Optuna). The searching Trainer itself is left as it was (its config, model and state).

How a trial's Trainer is built: kiln/engine/hp_trial.py (shared with the Ray backend).

With `backend="ray"` the trials run in Ray Tune instead (kiln/engine/hp_search_ray.py, `pip install
'kiln[ray]'`); SigOpt, HF's other backend, is not available."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.engine.hp_trial import TrialRecipe, TrialRun, trial_config
from kiln.utils.errors import KilnError


@dataclass
class BestRun:
    """HF's `trainer_utils.BestRun`: the best trial's id, objective and hyperparameters."""

    run_id: str
    objective: float | list[float]
    hyperparameters: dict[str, Any]
    run_summary: Any | None = None


def default_hp_space_optuna(trial: Any) -> dict[str, Any]:
    """HF's default search space."""
    return {
        "learning_rate": trial.suggest_float("learning_rate", 1e-6, 1e-4, log=True),
        "num_train_epochs": trial.suggest_int("num_train_epochs", 1, 5),
        "seed": trial.suggest_int("seed", 1, 40),
        "per_device_train_batch_size": trial.suggest_categorical("per_device_train_batch_size", [4, 8, 16, 32, 64]),
    }


def default_compute_objective(metrics: dict[str, float]) -> float:
    """HF's default: the evaluation loss when there are no other metrics, else the sum of the metrics
    (without the loss, the epoch and speed figures)."""
    metrics = copy.deepcopy(metrics)
    loss = metrics.pop("eval_loss", None)
    metrics.pop("epoch", None)
    for key in [k for k in metrics if k.endswith(("_runtime", "_per_second", "_compilation_time"))]:
        metrics.pop(key)
    return loss if not metrics else sum(metrics.values())  # type: ignore[return-value]


def check_searchable(backend: str | None, model_init: Any, user_optimizer: bool, world_size: int) -> None:
    """What a search needs of the searching Trainer, refused in one sentence each."""
    if backend not in (None, "optuna", "ray"):
        raise KilnError(
            f"hyperparameter_search backend {backend!r} is not available: kiln searches with optuna or ray."
        )
    if model_init is None:
        raise KilnError("hyperparameter_search needs model_init= (a callable building a fresh model for each trial).")
    if user_optimizer:
        raise KilnError(
            "hyperparameter_search cannot reuse the optimizer passed in optimizers=: override "
            "create_optimizer (or use the config's optim) so each trial builds its own."
        )
    if world_size > 1:
        raise KilnError("hyperparameter_search runs in one process; start it without a launcher.")


@dataclass(eq=False)
class HyperparameterSearch:
    """HF's `hyperparameter_search` for one Trainer (which owns it): each trial's Trainer is built from
    `recipe`, so the searching Trainer itself is left as it was."""

    recipe: TrialRecipe

    def run(
        self,
        hp_space: Callable[[Any], dict[str, Any]] | None,
        compute_objective: Callable[[dict[str, float]], float | list[float]] | None,
        n_trials: int,
        direction: str | list[str],
        backend: str | None,
        hp_name: Callable[[Any], str] | None,
        **kwargs: Any,
    ) -> BestRun | list[BestRun]:
        """The best run, or the Pareto-best runs for several directions (Optuna); kwargs go to
        `optuna.create_study`, or with `backend="ray"` to Ray Tune (HF's `resources_per_trial`, `scheduler`, ...)."""
        compute_objective = compute_objective or default_compute_objective
        if backend == "ray":
            from kiln.engine.hp_search_ray import run_hp_search_ray

            found = run_hp_search_ray(self.recipe, hp_space, compute_objective, n_trials, direction, hp_name, **kwargs)
            return BestRun(*found)
        return self._optuna(
            hp_space or default_hp_space_optuna, compute_objective, n_trials, direction, hp_name, kwargs
        )

    def _optuna(
        self,
        hp_space: Callable[[Any], dict[str, Any]],
        compute_objective: Callable[[dict[str, float]], float | list[float]],
        n_trials: int,
        direction: str | list[str],
        hp_name: Callable[[Any], str] | None,
        study_kwargs: dict[str, Any],
    ) -> BestRun | list[BestRun]:
        from kiln.loggers.base import require

        require("optuna", "optuna", "hyperparameter_search")
        import optuna

        several = isinstance(direction, (list, tuple))
        study = (
            optuna.create_study(directions=list(direction), **study_kwargs)  # type: ignore[arg-type]  # optuna's stub wants Literal["minimize", "maximize"]; HF's signature takes str, which optuna validates
            if several
            else optuna.create_study(direction=direction, **study_kwargs)  # type: ignore[arg-type]  # as above
        )
        base = self.recipe.config

        def objective(trial: Any) -> float | list[float]:
            params = hp_space(trial)
            config = trial_config(base, trial, params, hp_name)
            run = TrialRun(trial, config, params, compute_objective, prune=not several)
            trainer = self.recipe.build(run)
            trainer.fit(trial=trial)  # model_init(trial), its own optimizer, state and folder
            if run.objective is None:  # no evaluation during training: evaluate once at the end
                run.objective = compute_objective(trainer.evaluate())
            return run.objective

        study.optimize(objective, n_trials=n_trials)
        if several:
            return [BestRun(str(t.number), t.values, t.params) for t in study.best_trials]
        best = study.best_trial
        value = best.value
        assert value is not None  # the best trial of a single-objective study is a completed one
        return BestRun(str(best.number), value, best.params)
