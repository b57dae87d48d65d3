"""`Trainer.hyperparameter_search` (HF) with Optuna: every trial trains a fresh model from
`model_init` with the trial's hyperparameters applied to the config, in `output_dir/run-<n>`, and is
scored by `compute_objective` on its evaluation metrics. Evaluations during training report to the
trial, so Optuna's pruners can stop a poor trial early (single objective only, as in Optuna).

Ray Tune and SigOpt, HF's other backends, are not available; the search runs in one process."""

from __future__ import annotations

import copy
import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from kiln.engine.model.model_init import call_model_init
from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from torch import nn

    from kiln.engine.protocols import TrainerLike


@dataclass
class BestRun:
    """HF's `trainer_utils.BestRun`: the best trial's id, objective and hyperparameters."""

    run_id: str
    objective: Union[float, list[float]]
    hyperparameters: dict[str, Any]
    run_summary: Optional[Any] = None


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


class HyperparameterSearchMixin:
    def hyperparameter_search(
        self: "TrainerLike",
        hp_space: Optional[Callable[[Any], dict[str, Any]]] = None,
        compute_objective: Optional[Callable[[dict[str, float]], Union[float, list[float]]]] = None,
        n_trials: int = 20,
        direction: Union[str, list[str]] = "minimize",
        backend: Optional[str] = None,
        hp_name: Optional[Callable[[Any], str]] = None,
        **kwargs: Any,
    ) -> Union[BestRun, list[BestRun]]:
        """Search hyperparameters with Optuna (HF's signature); kwargs go to `optuna.create_study`.
        Returns the best run, or the Pareto-best runs for several directions."""
        if backend not in (None, "optuna"):
            raise KilnError(f"hyperparameter_search backend {backend!r} is not available: kiln searches with optuna.")
        if self.model_init is None:
            raise KilnError("hyperparameter_search needs model_init= (a callable building a fresh model for each trial).")
        if self._user_optimizer:
            raise KilnError("hyperparameter_search cannot reuse the optimizer passed in optimizers=: override "
                            "create_optimizer (or use the config's optim) so each trial builds its own.")
        if self.strategy.world_size > 1:
            raise KilnError("hyperparameter_search runs in one process; start it without a launcher.")
        from kiln.loggers.base import require

        require("optuna", "optuna", "hyperparameter_search")
        import optuna

        hp_space = hp_space or default_hp_space_optuna
        compute_objective = compute_objective or default_compute_objective
        several = isinstance(direction, (list, tuple))
        study = optuna.create_study(directions=list(direction), **kwargs) if several else \
            optuna.create_study(direction=direction, **kwargs)

        def objective(trial: Any) -> Union[float, list[float]]:
            params = hp_space(trial)
            child = self._trial_trainer(trial, params, hp_name, compute_objective, prune=not several)
            child.fit(trial=trial)
            if child._objective is None:  # no evaluation during training: evaluate once at the end
                child._objective = compute_objective(child.evaluate())
            return child._objective

        study.optimize(objective, n_trials=n_trials)
        if several:
            return [BestRun(str(t.number), t.values, t.params) for t in study.best_trials]
        best = study.best_trial
        return BestRun(str(best.number), best.value, best.params)

    def _trial_trainer(self: "TrainerLike", trial: Any, params: dict[str, Any], hp_name: Optional[Callable[[Any], str]],
                       compute_objective: Callable[[dict[str, float]], Any], prune: bool) -> "TrainerLike":
        """A fresh Trainer of the same class for one trial: the config with `params` applied (HF
        names or dotted keys), its own output folder, a fresh model from model_init(trial)."""
        from omegaconf import OmegaConf

        from kiln.config.load import load_config

        run_name = hp_name(trial) if hp_name is not None else f"run-{trial.number}"
        base = OmegaConf.to_container(self.config, resolve=True)
        # the trial's values (HF names or dotted kiln keys) are a layer on top of the config, so they win
        config = load_config(base, {**params, "output_dir": os.path.join(self.config.output_dir, run_name)})
        # built by kiln's own __init__ (seed, then model_init), exactly as a plain Trainer builds its model
        model_init = functools.partial(call_model_init, self.model_init, trial)
        child = _sibling(self, config, model_init)
        child.state.is_hyper_param_search, child.state.trial_name = True, run_name
        child.state.trial_params = dict(params)
        child._trial, child._compute_objective, child._prune = trial, compute_objective, prune
        return child

    def _report_to_trial(self: "TrainerLike", metrics: dict[str, float]) -> None:
        """After each evaluation during a trial: record the objective and let Optuna prune."""
        trial = getattr(self, "_trial", None)
        if trial is None:
            return
        self._objective = self._compute_objective(metrics)
        if self._prune:
            import optuna

            trial.report(self._objective, self.state.global_step)
            if trial.should_prune():
                self.control = self.callback_handler.call("on_train_end", self.config, self.state, self.control)
                raise optuna.TrialPruned()


#: attributes kiln sets on a Trainer while it trains or evaluates (not by __init__): never carried into a trial
_RUN_STATE = frozenset({"_runs_started", "_created_lr_scheduler", "_eval_dataloaders",
                        "_ignore_keys_for_eval", "_gen_kwargs", "_eval_step_name"})


def _sibling(parent: "TrainerLike", config: Any, model_init: Callable[..., "nn.Module"]) -> "TrainerLike":
    """A Trainer of the parent's (sub)class for one trial, without calling the subclass's own `__init__`,
    whose signature kiln cannot know (HF reuses its one Trainer instead). kiln's `__init__` builds the
    trial's model, state, strategy and callbacks; whatever else the subclass's `__init__` set on the parent
    (attributes, callbacks it added) is carried over, so its overrides work in every trial."""
    child = type(parent).__new__(type(parent))
    type(parent).kiln_init(child, None, config, model_init=model_init, **parent._init_kwargs)
    for key, value in vars(parent).items():
        if key not in _RUN_STATE:  # the parent's own runs (a fit() before the search) stay the parent's
            child.__dict__.setdefault(key, value)
    present = {type(cb) for cb in child.callback_handler.callbacks}
    for cb in parent.callback_handler.callbacks:
        if type(cb) not in present:
            child.add_callback(cb)
    return child
