"""How a hyperparameter-search trial gets its Trainer (Optuna's in hp_search.py, Ray Tune's in
hp_search_ray.py): through the searching Trainer's own class and the arguments its constructor was
called with (`Trainer.__new__` keeps them), so a subclass's `__init__` runs for every trial. While
`build_trial_trainer` constructs it, `building_trial()` names the trial's `TrialRun`: kiln's
`Trainer.__init__` then takes the trial's config and builds `model_init(trial)`, whatever the subclass
passes up, and the Run it starts holds the trial (`Run.trial`), which records each evaluation's objective
(`TrialRun.report`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.callbacks.base import Callback


@dataclass(eq=False)
class TrialRun:
    """One search trial, as its Trainer is built and trained (`Run.trial`)."""

    trial: Any  # Optuna's trial, or hp_search_ray.RayTrial
    config: Any  # the searching Trainer's config with the trial's values, in the trial's own folder
    params: dict[str, Any]
    compute_objective: Callable[[dict[str, float]], Any]
    prune: bool  # report each evaluation to Optuna, which may prune the trial
    objective: Any = None  # compute_objective on the last evaluation's metrics

    @property
    def name(self) -> str:
        return os.path.basename(self.config.output_dir)

    def report(self, metrics: dict[str, float], step: int) -> bool:
        """After an evaluation during training: record the objective so far and, with pruning, report it to
        Optuna; True when Optuna prunes the trial (its Trainer then ends the run: Trainer._report_to_trial)."""
        self.objective = self.compute_objective(metrics)
        if not self.prune:
            return False
        self.trial.report(self.objective, step)
        return bool(self.trial.should_prune())


@dataclass(eq=False)
class TrialRecipe:
    """What every trial builds its Trainer from: the searching Trainer's class and the arguments its constructor
    was called with (so a subclass's `__init__` runs), its config (each trial's is this with the trial's values)
    and its callbacks (those added after construction come along)."""

    cls: type
    init_call: tuple[tuple[Any, ...], dict[str, Any]]
    config: Any
    callbacks: list[Callback]

    def build(self, trial_run: TrialRun) -> Any:
        """The trial's Trainer (`build_trial_trainer`)."""
        return build_trial_trainer(self.cls, self.init_call, trial_run, self.callbacks)


#: the trial whose Trainer is being constructed (read by kiln's Trainer.__init__)
_BUILDING: ContextVar[TrialRun | None] = ContextVar("kiln_building_trial", default=None)


def building_trial() -> TrialRun | None:
    return _BUILDING.get()


def build_trial_trainer(
    cls: type,
    init_call: tuple[tuple[Any, ...], dict[str, Any]],
    trial_run: TrialRun,
    callbacks: Iterable[Callback] = (),
) -> Any:
    """`cls(*args, **kwargs)` with the arguments the searching Trainer was constructed with, as the
    trial's Trainer; then `callbacks` (the searching Trainer's) whose class it lacks, e.g. added with
    `add_callback` after construction."""
    args, kwargs = init_call
    token = _BUILDING.set(trial_run)
    try:
        trainer = cls(*args, **kwargs)
    finally:
        _BUILDING.reset(token)
    have = {type(cb) for cb in trainer.callback_handler.callbacks}
    for cb in callbacks:
        if type(cb) not in have:
            trainer.add_callback(cb)
    return trainer


def trial_config(base: Any, trial: Any, params: dict[str, Any], hp_name: Callable[[Any], str] | None) -> Any:
    """`base` (a loaded config) with `params` applied (HF names or dotted keys) and the trial's own output folder."""
    from omegaconf import OmegaConf

    from kiln.config.load import load_config

    run_name = hp_name(trial) if hp_name is not None else f"run-{trial.number}"
    plain = cast(dict[str, Any], OmegaConf.to_container(base, resolve=True))  # `base` is a DictConfig: str keys
    # the trial's values are a layer on top of the config, so they win
    own = {"output_dir": os.path.join(base.output_dir, run_name)}
    if base.save.remote_dir:  # an output_dir URL: each trial's checkpoints under a prefix of their own too
        own["save.remote_dir"] = f"{base.save.remote_dir}/{run_name}"
    config = load_config(plain, {**params, **own})
    for section in ("strategy", "precision"):  # built once, with the Trainer
        if OmegaConf.to_container(config[section]) != OmegaConf.to_container(base[section]):
            raise KilnError(
                f"hyperparameter_search cannot change the {section} per trial (the Trainer set it up "
                f"once); search the {section} by running one search per {section}."
            )
    return config
