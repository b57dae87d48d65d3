"""`Trainer.hyperparameter_search` (HF) with Optuna: every trial is a new run of the same Trainer, as
in HF: a fresh model from `model_init(trial)`, the trial's hyperparameters applied to the config, its
files in `output_dir/run-<n>`, scored by `compute_objective` on its evaluation metrics. Evaluations
during training report to the trial, so Optuna's pruners can stop a poor trial early (single
objective only, as in Optuna). The Trainer's own config comes back when the search ends.

With `backend="ray"` the trials run in Ray Tune instead (kiln/engine/hp_search_ray.py, `pip install
'kiln[ray]'`); SigOpt, HF's other backend, is not available."""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.callbacks.base import CallbackHandler
    from kiln.engine.callbacks.state import TrainerControl, TrainerState
    from kiln.engine.run import Run
    from kiln.strategies.base import Strategy


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
    """HF's `hyperparameter_search` on the Trainer (the class these methods live on is
    `kiln.engine.trainer.Trainer`); the attributes below are the Trainer's that the search uses."""

    config: Any
    args: Any
    strategy: "Strategy"
    run: "Run"
    state: "TrainerState"
    control: "TrainerControl"
    callback_handler: "CallbackHandler"
    model_init: Optional[Callable[..., Any]]
    _trial: Any
    _objective: Any
    _trial_params: dict[str, Any]
    _trial_name: str

    if TYPE_CHECKING:  # the Trainer's
        def fit(self, resume_from_checkpoint: Any = None, trial: Any = None,
                ignore_keys_for_eval: Optional[list[str]] = None) -> Any: ...
        def evaluate(self, eval_dataset: Any = None, ignore_keys: Optional[list[str]] = None,
                     metric_key_prefix: str = "eval", **gen_kwargs: Any) -> dict[str, float]: ...

    def hyperparameter_search(
        self,
        hp_space: Optional[Callable[[Any], dict[str, Any]]] = None,
        compute_objective: Optional[Callable[[dict[str, float]], Union[float, list[float]]]] = None,
        n_trials: int = 20,
        direction: Union[str, list[str]] = "minimize",
        backend: Optional[str] = None,
        hp_name: Optional[Callable[[Any], str]] = None,
        **kwargs: Any,
    ) -> Union[BestRun, list[BestRun]]:
        """Search hyperparameters with Optuna (HF's signature); kwargs go to `optuna.create_study`.
        Returns the best run, or the Pareto-best runs for several directions. `backend="ray"`: with
        Ray Tune, kwargs as HF's (`resources_per_trial`, `scheduler`, ...)."""
        if backend not in (None, "optuna", "ray"):
            raise KilnError(f"hyperparameter_search backend {backend!r} is not available: kiln searches with optuna or ray.")
        if self.model_init is None:
            raise KilnError("hyperparameter_search needs model_init= (a callable building a fresh model for each trial).")
        if self.run.user_optimizer:
            raise KilnError("hyperparameter_search cannot reuse the optimizer passed in optimizers=: override "
                            "create_optimizer (or use the config's optim) so each trial builds its own.")
        if self.strategy.world_size > 1:
            raise KilnError("hyperparameter_search runs in one process; start it without a launcher.")
        compute_objective = compute_objective or default_compute_objective
        if backend == "ray":
            from kiln.engine.hp_search_ray import run_hp_search_ray

            return BestRun(*run_hp_search_ray(self, hp_space, compute_objective, n_trials, direction, hp_name, **kwargs))
        from kiln.loggers.base import require

        require("optuna", "optuna", "hyperparameter_search")
        import optuna

        hp_space = hp_space or default_hp_space_optuna
        several = isinstance(direction, (list, tuple))
        study = optuna.create_study(directions=list(direction), **kwargs) if several else \
            optuna.create_study(direction=direction, **kwargs)

        def objective(trial: Any) -> Union[float, list[float]]:
            params = hp_space(trial)
            config = self._trial_config(trial, params, hp_name)
            with self._trial_settings(config, params, trial, compute_objective, prune=not several):
                self.fit(trial=trial)  # a new run: model_init(trial), its own optimizer, state and folder
                if self._objective is None:  # no evaluation during training: evaluate once at the end
                    self._objective = compute_objective(self.evaluate())
                return self._objective

        study.optimize(objective, n_trials=n_trials)
        if several:
            return [BestRun(str(t.number), t.values, t.params) for t in study.best_trials]
        best = study.best_trial
        return BestRun(str(best.number), best.value, best.params)

    def _trial_config(self, trial: Any, params: dict[str, Any], hp_name: Optional[Callable[[Any], str]]) -> Any:
        """The config with `params` applied (HF names or dotted keys) and the trial's own output folder."""
        from omegaconf import OmegaConf

        from kiln.config.load import load_config

        run_name = hp_name(trial) if hp_name is not None else f"run-{trial.number}"
        base = OmegaConf.to_container(self.config, resolve=True)
        # the trial's values are a layer on top of the config, so they win
        config = load_config(base, {**params, "output_dir": os.path.join(self.config.output_dir, run_name)})
        for section in ("strategy", "precision"):  # built once, with the Trainer
            if OmegaConf.to_container(config[section]) != OmegaConf.to_container(self.config[section]):
                raise KilnError(f"hyperparameter_search cannot change the {section} per trial (the Trainer set it up "
                                f"once); search the {section} by running one search per {section}.")
        return config

    @contextlib.contextmanager
    def _trial_settings(self, config: Any, params: dict[str, Any], trial: Any,
                        compute_objective: Callable[[dict[str, float]], Any], prune: bool) -> Iterator[None]:
        """The Trainer as one trial runs it: the trial's config (also for the loggers, whose files go in
        the trial's folder), the trial to report to; everything is put back afterwards."""
        from kiln.engine.callbacks.defaults import logger_callback
        from kiln.engine.callbacks.loggers import LoggerCallback

        saved = self.config, self.args
        handler = self.callback_handler
        old_loggers = [cb for cb in handler.callbacks if isinstance(cb, LoggerCallback)]
        for cb in old_loggers:
            handler.pop(cb)
        if old_loggers:
            handler.add(logger_callback(config))
        self.config = self.args = config
        self._trial, self._compute_objective, self._prune, self._objective = trial, compute_objective, prune, None
        self._trial_params, self._trial_name = dict(params), os.path.basename(config.output_dir)
        try:
            yield
        finally:
            for cb in [cb for cb in handler.callbacks if isinstance(cb, LoggerCallback)]:
                handler.pop(cb)
            for cb in old_loggers:
                handler.add(cb)
            self.config, self.args = saved
            self._trial = None

    def _report_to_trial(self, metrics: dict[str, float]) -> None:
        """After each evaluation during a trial: record the objective and let Optuna prune."""
        trial = self._trial
        if trial is None:
            return
        self._objective = self._compute_objective(metrics)
        if self._prune:
            import optuna

            trial.report(self._objective, self.state.global_step)
            if trial.should_prune():
                self.control = self.callback_handler.call("on_train_end", self.config, self.state, self.control)
                raise optuna.TrialPruned()
