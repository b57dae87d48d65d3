"""hyperparameter_search with Optuna: each trial trains a fresh model from model_init(trial) with its
hyperparameters in its own folder, the best run is the one a plain Trainer with those settings
reproduces, evaluations during training report to the trial so a pruner can stop it, several
directions give the Pareto-best runs, and misuse gets one clear sentence."""

from __future__ import annotations

import os

import pytest
import torch

from kiln import Callback, Trainer
from kiln.engine.hp_search import BestRun, default_compute_objective
from kiln.utils.errors import KilnError
from tests.helpers import TinyRegressor, base_config, regression_data

optuna = pytest.importorskip("optuna")
optuna.logging.set_verbosity(optuna.logging.WARNING)


def _config(tmp_path, **extra):
    return base_config(
        tmp_path, **{"max_steps": 6, "per_device_train_batch_size": 8, "seed": 3, "learning_rate": 1e-2, **extra}
    )


def _trainer(tmp_path, **extra):
    data = regression_data(n=48)
    return Trainer(
        None, _config(tmp_path, **extra), model_init=TinyRegressor, train_dataset=data[:32], eval_dataset=data[32:]
    )


def _grid(**space):
    return optuna.samplers.GridSampler({k: list(v) for k, v in space.items()}, seed=0)


def test_best_run_is_reproduced_by_a_plain_trainer(tmp_path):
    trials = []

    class Record(Callback):
        def on_train_begin(self, config, state, control, **kw):
            trials.append((config.output_dir, state.is_hyper_param_search, state.trial_params, config.optim.lr))

    data = regression_data(n=48)
    dropout = lambda: TinyRegressor(dropout=0.3)  # noqa: E731  (training draws random numbers too)
    trainer = Trainer(
        None,
        _config(tmp_path),
        model_init=dropout,
        train_dataset=data[:32],
        eval_dataset=data[32:],
        callbacks=[Record()],
    )
    best = trainer.hyperparameter_search(
        hp_space=lambda t: {"learning_rate": t.suggest_categorical("learning_rate", [0.0, 0.05])},
        n_trials=2,
        sampler=_grid(learning_rate=[0.0, 0.05]),
    )
    assert isinstance(best, BestRun) and best.hyperparameters == {"learning_rate": 0.05}
    out = str(tmp_path / "out")
    assert sorted(t[0] for t in trials) == [f"{out}/run-0", f"{out}/run-1"]  # each trial in its own folder
    assert all(searching and params == {"learning_rate": lr} for _, searching, params, lr in trials)  # applied
    assert sorted(t[3] for t in trials) == [0.0, 0.05]

    plain = Trainer(
        None,
        _config(tmp_path / "plain", learning_rate=0.05),
        model_init=dropout,
        train_dataset=data[:32],
        eval_dataset=data[32:],
    )
    plain.fit()
    assert best.objective == plain.evaluate()["eval_loss"]  # lr 0 would leave the loss high


def test_model_init_receives_the_trial(tmp_path):
    built = []

    def model_init(trial):
        hidden = trial.suggest_categorical("hidden", [4, 32]) if trial is not None else 16
        built.append(hidden)
        return TinyRegressor(hidden=hidden)

    data = regression_data(n=48)
    trainer = Trainer(None, _config(tmp_path), model_init=model_init, train_dataset=data[:32], eval_dataset=data[32:])
    best = trainer.hyperparameter_search(hp_space=lambda t: {}, n_trials=2, sampler=_grid(hidden=[4, 32]))
    assert built[0] == 16 and sorted(built[1:]) == [4, 32]  # built[0]: the Trainer's own model (trial None)
    assert best.hyperparameters["hidden"] in (4, 32)


def test_evaluations_report_to_the_trial_and_a_pruner_stops_it(tmp_path):
    ended = []

    class Ends(Callback):
        def on_train_end(self, config, state, control, **kw):
            ended.append((state.trial_name, state.global_step))

    class PruneSecond(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            return trial.number == 1

    data = regression_data(n=48)
    trainer = Trainer(
        None,
        _config(tmp_path, eval_strategy="steps", eval_steps=2),
        model_init=TinyRegressor,
        train_dataset=data[:32],
        eval_dataset=data[32:],
        callbacks=[Ends()],
    )
    best = trainer.hyperparameter_search(
        hp_space=lambda t: {"learning_rate": t.suggest_categorical("learning_rate", [0.01, 0.02])},
        n_trials=2,
        sampler=_grid(learning_rate=[0.01, 0.02]),
        pruner=PruneSecond(),
    )
    assert ended == [("run-0", 6), ("run-1", 2)]  # the second trial stopped at its first evaluation
    assert best.run_id == "0"


def test_several_directions_give_the_pareto_best_runs(tmp_path):
    trainer = _trainer(tmp_path)
    runs = trainer.hyperparameter_search(
        hp_space=lambda t: {"learning_rate": t.suggest_categorical("learning_rate", [0.0, 0.05])},
        compute_objective=lambda m: [m["eval_loss"], m["eval_loss"]],
        direction=["minimize", "maximize"],
        n_trials=2,
        sampler=_grid(learning_rate=[0.0, 0.05]),
    )
    assert isinstance(runs, list) and len(runs) == 2  # each is best in one direction
    assert {r.hyperparameters["learning_rate"] for r in runs} == {0.0, 0.05}


def test_default_objective_is_the_loss_or_the_sum_of_the_metrics():
    assert default_compute_objective({"eval_loss": 0.5, "epoch": 1.0, "eval_runtime": 3.0}) == 0.5
    assert default_compute_objective(
        {"eval_loss": 0.5, "eval_accuracy": 0.75, "eval_f1": 0.5, "eval_samples_per_second": 9.0}
    ) == pytest.approx(1.25)


def test_misuse_is_refused(tmp_path):
    with pytest.raises(KilnError, match="needs model_init"):
        Trainer(TinyRegressor(), _config(tmp_path), train_dataset=regression_data(n=8)).hyperparameter_search(
            n_trials=1
        )
    with pytest.raises(KilnError, match="backend 'sigopt' is not available: kiln searches with optuna or ray"):
        _trainer(tmp_path).hyperparameter_search(backend="sigopt")
    model = TinyRegressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(KilnError, match="cannot reuse the optimizer"):
        Trainer(
            None,
            _config(tmp_path),
            model_init=TinyRegressor,
            optimizers=(opt, None),
            train_dataset=regression_data(n=8),
        ).hyperparameter_search(n_trials=1)
    with pytest.raises(KilnError, match="fit\\(trial=...\\) is driven by hyperparameter_search"):
        _trainer(tmp_path).fit(trial={"learning_rate": 0.1})


def test_trials_work_for_a_subclass_with_its_own_init(tmp_path):
    """A Trainer subclass whose __init__ takes other arguments (and adds a callback) still runs trials, and
    its overrides and attributes are used in each trial."""
    seen = []

    class Marker(Callback):
        def on_train_begin(self, config, state, control, **kw):
            seen.append(("train_begin", config.output_dir))

    class Weighted(Trainer):
        def __init__(self, loss_scale, *, data):
            super().__init__(
                None,
                _config(tmp_path),
                model_init=lambda: seen.append(("built",)) or TinyRegressor(),
                train_dataset=data[:32],
                eval_dataset=data[32:],
            )
            self.loss_scale = loss_scale
            self.add_callback(Marker())

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.append(("loss", self.loss_scale))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trainer = Weighted(2.0, data=regression_data(n=48))
    trainer.fit()  # a run of its own first: its optimizer and run state must not leak into the trials
    seen.clear()
    best = trainer.hyperparameter_search(
        hp_space=lambda t: {"learning_rate": t.suggest_categorical("learning_rate", [0.0, 0.05])},
        n_trials=2,
        sampler=_grid(learning_rate=[0.0, 0.05]),
    )
    assert best.hyperparameters == {"learning_rate": 0.05}
    out = str(tmp_path / "out")
    assert sorted(s[1] for s in seen if s[0] == "train_begin") == [f"{out}/run-0", f"{out}/run-1"]
    assert {s[1] for s in seen if s[0] == "loss"} == {2.0}
    assert seen.count(("built",)) == 2  # one model per trial: the parent's run state is not carried over


def test_each_trial_builds_its_trainer_through_the_subclass_constructor(tmp_path):
    """Every trial's Trainer is constructed by the subclass's own __init__ (with the arguments the searching
    Trainer was given): what __init__ sets is what that trial's training sees, and the searching Trainer is
    left as it was."""
    built, used = [], []

    class Numbered(Trainer):
        def __init__(self, tag, **kw):
            super().__init__(**kw)
            built.append(self)
            self.number = (tag, len(built))  # set by __init__ alone: a Trainer built another way lacks it

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            used.append((self.number, self.config.output_dir, self.config.optim.lr))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    data = regression_data(n=48)
    trainer = Numbered(
        "t", config=_config(tmp_path), model_init=TinyRegressor, train_dataset=data[:32], eval_dataset=data[32:]
    )
    model = trainer.model
    trainer.hyperparameter_search(
        hp_space=lambda t: {"learning_rate": t.suggest_categorical("learning_rate", [0.0, 0.05])},
        n_trials=2,
        sampler=_grid(learning_rate=[0.0, 0.05]),
    )
    assert len(built) == 3 and all(type(t) is Numbered for t in built)
    out = str(tmp_path / "out")
    per_trial = {(number, folder, lr) for number, folder, lr in used}
    assert {(n, os.path.basename(f)) for n, f, _ in per_trial} == {(("t", 2), "run-0"), (("t", 3), "run-1")}
    assert {lr for *_, lr in per_trial} == {0.0, 0.05} and all(f.startswith(out) for _, f, _ in per_trial)
    assert trainer.config.output_dir == out and trainer.model is model and trainer.state.global_step == 0
    assert built[1].model is not model and built[1].state.trial_name == "run-0" and built[1].state.is_hyper_param_search
