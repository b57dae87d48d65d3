"""`Trainer.hyperparameter_search(backend="ray")`: HF's Ray Tune backend
(`transformers.integrations.integration_utils.run_hp_search_ray`). Ray Tune runs each trial in a
process of its own (an actor), where the trial builds its Trainer exactly as an Optuna trial does
(`hp_trial.build_trial_trainer`): through the searching Trainer's class and the arguments its
constructor was called with (so a subclass's `__init__` runs), with the trial's hyperparameters
applied and its files in `output_dir/run-<trial id>`. As HF's
`_report_to_hp_search`, the trial reports to Ray Tune after every evaluation: the evaluation metrics
with `objective` (`compute_objective` on them) and `step`, so Tune's schedulers (ASHA, median
stopping, ...) can stop a poor trial early; a trial without evaluations during training evaluates
once at the end and reports that. Ray Tune picks the best trial by the last `objective` each
reported, and the best comes back as HF's `BestRun` (run_id: Ray's trial id, run_summary: Ray's
`ResultGrid`).

As in HF: the search space is a dict of Ray Tune distributions (`hp_space(None)`; HF's default
below), keyword arguments go to Ray Tune (`resources_per_trial`, default one CPU per trial,
`scheduler`, `search_alg`, ...), and Ray is started locally for the search unless it is running."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kiln.engine.callbacks.base import Callback
from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.engine.callbacks.state import TrainerControl, TrainerState
    from kiln.engine.hp_trial import TrialRecipe

#: keyword arguments that configure the search (Ray Tune's TuneConfig) and the run (Ray Tune's RunConfig)
_TUNE = (
    "search_alg",
    "scheduler",
    "max_concurrent_trials",
    "time_budget_s",
    "reuse_actors",
    "trial_name_creator",
    "trial_dirname_creator",
)
_RUN = ("name", "storage_path", "stop", "callbacks", "verbose", "failure_config")


def default_hp_space_ray(trial: Any) -> dict[str, Any]:
    """HF's default search space for Ray Tune."""
    from ray import tune

    return {
        "learning_rate": tune.loguniform(1e-6, 1e-4),
        "num_train_epochs": tune.choice(list(range(1, 6))),
        "seed": tune.uniform(1, 40),
        "per_device_train_batch_size": tune.choice([4, 8, 16, 32, 64]),
    }


class RayTrial(dict):
    """What `model_init(trial)` and `hp_name(trial)` receive in a Ray trial: the trial's hyperparameters
    (a dict, as HF passes them), with `number` (Ray's trial id) naming its folder `run-<number>`."""

    def __init__(self, params: dict[str, Any], number: str) -> None:
        super().__init__(params)
        self.number = number


def run_hp_search_ray(
    recipe: TrialRecipe,
    hp_space: Callable[[Any], dict[str, Any]] | None,
    compute_objective: Callable[[dict[str, float]], Any],
    n_trials: int,
    direction: Any,
    hp_name: Callable[[Any], str] | None,
    **kwargs: Any,
) -> tuple[str, float, dict[str, Any], Any]:
    """Run the search; the best trial as `BestRun`'s fields (run id, objective, hyperparameters, Ray's
    ResultGrid). (`BestRun` is built by kiln.engine.hp_search, which imports this module.)"""
    from kiln.launch.ray import require_ray

    require_ray("hyperparameter_search(backend='ray')")
    if direction not in ("minimize", "maximize"):
        raise KilnError(
            f"hyperparameter_search(backend='ray') ranks trials by one objective: direction must be 'minimize' "
            f"or 'maximize', not {direction!r} (several directions need the optuna backend)."
        )
    unknown = sorted(set(kwargs) - {*_TUNE, *_RUN, "resources_per_trial"})
    if unknown:
        raise KilnError(
            f"hyperparameter_search(backend='ray') does not know {', '.join(unknown)}; it takes "
            f"resources_per_trial, {', '.join(_TUNE)} (Ray Tune's TuneConfig) and {', '.join(_RUN)} (its RunConfig)."
        )
    import ray
    from ray import tune

    mode = direction[:3]
    output_dir = str(recipe.config.output_dir)
    shipped = _recipe(recipe, compute_objective, hp_name)
    resources = kwargs.pop("resources_per_trial", {"cpu": 1})
    kwargs.setdefault("reuse_actors", True)  # a trial process imports torch and kiln once, not once per trial
    run = {
        "name": "hp_search",
        "storage_path": os.path.abspath(os.path.join(output_dir, "ray_results")),
        "verbose": 0,
        **{k: kwargs.pop(k) for k in _RUN if k in kwargs},
    }
    started = not ray.is_initialized()
    if started:  # a local instance for the search only (as `kiln fit --ray`)
        ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False)
    try:
        tuner = tune.Tuner(
            tune.with_resources(tune.with_parameters(_trial, recipe=shipped), resources),
            param_space=(hp_space or default_hp_space_ray)(None),
            tune_config=tune.TuneConfig(num_samples=n_trials, metric="objective", mode=mode, **kwargs),
            run_config=tune.RunConfig(**run),
        )
        grid = tuner.fit()
        failed = [grid[i].error for i in range(len(grid)) if grid[i].error is not None]  # ResultGrid: no __iter__
        if len(failed) == len(grid):
            raise KilnError(f"every Ray Tune trial failed; the first: {type(failed[0]).__name__}: {failed[0]}")
        best = grid.get_best_result(metric="objective", mode=mode, scope="last")
    finally:
        if started:
            ray.shutdown()
    metrics, config = best.metrics, best.config
    assert metrics is not None and config is not None  # a trial that reported its objective has both
    return str(metrics["trial_id"]), metrics["objective"], dict(config), grid


def _recipe(
    recipe: TrialRecipe, compute_objective: Callable[..., Any], hp_name: Callable[[Any], str] | None
) -> dict[str, Any]:
    """What a trial builds its Trainer from (sent to each trial process by Ray's object store): `recipe` with its
    config as a plain container and only the callbacks that are not kiln's own (the trial's Trainer rebuilds those)."""
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(recipe.config, resolve=True)
    assert isinstance(config, dict)
    config["output_dir"] = os.path.abspath(str(recipe.config.output_dir))  # Tune runs a trial in a folder of its own
    callbacks = [cb for cb in recipe.callbacks if not type(cb).__module__.startswith("kiln.")]
    return {
        "trainer": replace(recipe, config=config, callbacks=callbacks),
        "compute_objective": compute_objective,
        "hp_name": hp_name,
    }


class TuneReport(Callback):
    """A trial's reports to Ray Tune: after each evaluation, its metrics with `objective` and `step`
    (`report`: `ray.tune.report`). With a dict of evaluation datasets, kiln evaluates them one by one
    (one `on_evaluate` each, `datasets` in all); the report comes once all are in, as one evaluation.

    When Tune stops the trial (a scheduler's STOP, a `stop` criterion), `report` ends with
    `SystemExit(0)`: the run then stops as an early-stopped run does (`should_training_stop`, so the
    step ends and `on_train_end` runs), reports nothing more, and the trial function exits with
    `SystemExit(0)` (see `_trial`)."""

    def __init__(
        self,
        compute_objective: Callable[[dict[str, float]], Any],
        datasets: int,
        report: Callable[[dict[str, Any]], None],
    ) -> None:
        self.compute_objective, self.datasets, self.report = compute_objective, datasets, report
        self.reported: list[dict[str, Any]] = []  # what went to Tune, in order
        self.stopped = False  # Tune stopped the trial
        self._pending: dict[str, Any] = {}
        self._evaluated = 0

    def on_evaluate(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self.stopped:
            return
        self._pending.update(kw.get("metrics") or {})
        self._evaluated += 1
        if self._evaluated % self.datasets:
            return
        metrics, self._pending = self._pending, {}
        result = {**metrics, "objective": self.compute_objective(dict(metrics)), "step": state.global_step}
        self.reported.append(result)
        try:
            self.report(result)
        except SystemExit as stop:  # Ray's answer to a report when Tune stops the trial
            if stop.code != 0:
                raise
            self.stopped = control.should_training_stop = True


def _trial(params: dict[str, Any], recipe: dict[str, Any]) -> None:
    """One trial, in Ray Tune's process: a Trainer like the searching one, trained with `params`,
    reporting to Tune after each evaluation."""
    from ray import tune

    from kiln.config.load import load_config
    from kiln.engine.hp_trial import TrialRun, trial_config

    trial = RayTrial(params, tune.get_context().get_trial_id())
    base = load_config(recipe["trainer"].config)
    config = trial_config(base, trial, _typed(base, params), recipe["hp_name"])
    run = TrialRun(trial, config, params, recipe["compute_objective"], prune=False)
    trainer = recipe["trainer"].build(run)
    datasets = len(trainer.eval_dataset) if isinstance(trainer.eval_dataset, Mapping) else 1
    reporter = TuneReport(recipe["compute_objective"], datasets, tune.report)
    trainer.add_callback(reporter)
    trainer.fit(trial=trial)
    if not reporter.reported:  # no evaluation during training: evaluate (and report) once at the end, as HF
        trainer.evaluate()
    if reporter.stopped:  # returning would report once more, to a Tune that no longer listens (and waits forever)
        raise SystemExit(0)


def _typed(config: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The trial's values in the types of the config keys they set (HF casts the same way): Ray's
    `tune.uniform` gives a float even for an integer key such as HF's default `seed`."""
    from omegaconf import OmegaConf

    from kiln.config.hf.aliases import PATHS

    out = dict(params)
    for key, value in params.items():
        current = OmegaConf.select(config, PATHS.get(key, key), default=None)
        if isinstance(current, int) and not isinstance(current, bool) and isinstance(value, float):
            out[key] = int(value)
    return out
