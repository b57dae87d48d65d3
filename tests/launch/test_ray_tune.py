"""`Trainer.hyperparameter_search(backend="ray")` (issue 32 item 1), as HF's Ray Tune backend: a
4-trial search on the package's local Ray instance (tests/launch/conftest.py), each trial a kiln fit
of its own in Ray Tune's process (its files in output_dir/run-<trial id>) that reports to Tune after
every evaluation (HF's `_report_to_hp_search`), so that a scheduler can stop it early, and the best
trial returned as a `BestRun`."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest

from kiln import Callback, Trainer
from kiln.engine.hp_search import BestRun, default_compute_objective
from kiln.engine.hp_search_ray import TuneReport
from kiln.utils.errors import KilnError
from tests.distributed.toy import Regressor, regression_data
from tests.installed import requires

pytestmark = [pytest.mark.distributed, requires("ray", "pip install 'kiln[ray]'")]
EVAL_STEPS, MAX_STEPS = 2, 6


def model_init(trial=None) -> Regressor:
    return Regressor()


class Ended(Callback):
    """Writes `<output_dir>/ended` (the step and this process's id) at `on_train_end`: the run ended as
    a run ends, not by an exception through the loop."""

    def on_train_end(self, config, state, control, **kw):
        with open(os.path.join(str(config.output_dir), "ended"), "w") as fh:
            json.dump({"step": state.global_step, "pid": os.getpid()}, fh)


class Marked(Trainer):
    """A subclass whose own __init__ takes another argument and sets an attribute that training reads: a
    trial's Trainer has it only if that __init__ ran in the trial's process. `create_optimizer` writes it to
    `<output_dir>/mark` with the learning rate and seed the trial trains with."""

    def __init__(self, *args, mark: str, **kw) -> None:
        super().__init__(*args, **kw)
        self.mark = mark

    def create_optimizer(self):
        os.makedirs(str(self.config.output_dir), exist_ok=True)
        with open(os.path.join(str(self.config.output_dir), "mark"), "w") as fh:
            fh.write(f"{self.mark} {self.config.optim.lr} {self.config.seed}")
        return super().create_optimizer()


def trainer(output_dir, callbacks=(), eval_dataset=None, cls=Trainer, cls_kwargs=None, **extra) -> Trainer:
    config = {
        "output_dir": str(output_dir),
        "max_steps": MAX_STEPS,
        "per_device_train_batch_size": 8,
        "report_to": "none",
        "eval_strategy": "steps",
        "eval_steps": EVAL_STEPS,
        "disable_tqdm": True,
        "save_strategy": "no",
        "seed": 1,
        "strategy": {"name": "single", "device": "cpu"},
        **extra,
    }
    return cls(
        None,
        config,
        model_init=model_init,
        train_dataset=regression_data(32),
        callbacks=list(callbacks),
        eval_dataset=regression_data(16, seed=1) if eval_dataset is None else eval_dataset,
        **(cls_kwargs or {}),
    )


def stop_second_trial():
    """A Tune scheduler that stops the second trial it hears from at that trial's first report, as
    ASHA stops a poor trial at its first rung (deterministic, whatever the trials' values)."""
    from ray.tune.schedulers import FIFOScheduler

    class StopSecondTrial(FIFOScheduler):
        def __init__(self) -> None:
            super().__init__()
            self.order: dict[str, int] = {}

        def on_trial_result(self, tune_controller, trial, result):
            first = trial.trial_id not in self.order
            self.order.setdefault(trial.trial_id, len(self.order))
            return self.STOP if first and self.order[trial.trial_id] == 1 else self.CONTINUE

    return StopSecondTrial()


def test_a_four_trial_ray_tune_search_reports_every_evaluation_and_returns_the_best_run(local_ray, tmp_path):
    from ray import tune

    t = trainer(tmp_path / "search", callbacks=[Ended()], cls=Marked, cls_kwargs={"mark": "marked"})
    best = t.hyperparameter_search(
        hp_space=lambda _: {"learning_rate": tune.loguniform(1e-4, 1e-1), "seed": tune.uniform(1, 40)},
        n_trials=4,
        direction="minimize",
        backend="ray",
        scheduler=stop_second_trial(),
    )
    assert isinstance(best, BestRun)
    grid = best.run_summary
    assert len(grid) == 4 and not grid.errors
    # every trial reported after each evaluation, the objective with the metrics; the stopped one only once
    reports = {r.metrics["trial_id"]: r.metrics_dataframe for r in grid}
    counts = sorted(len(frame) for frame in reports.values())
    assert counts == [1, 3, 3, 3]
    for frame in reports.values():
        assert list(frame["step"]) == list(range(EVAL_STEPS, EVAL_STEPS * len(frame) + 1, EVAL_STEPS))
        assert list(frame["objective"]) == list(frame["eval_loss"])
    # each trial was a kiln fit of its own, in its own folder, with its (integer) seed; each ended as a run
    # ends, the stopped one right after the evaluation Tune stopped it at, and Tune reused its process
    runs = sorted(p.name for p in (tmp_path / "search").iterdir() if p.name.startswith("run-"))
    assert runs == sorted(f"run-{trial_id}" for trial_id in reports)
    ended = {
        trial_id: json.loads((tmp_path / "search" / f"run-{trial_id}" / "ended").read_text()) for trial_id in reports
    }
    assert sorted(e["step"] for e in ended.values()) == [EVAL_STEPS, MAX_STEPS, MAX_STEPS, MAX_STEPS]
    assert len({e["pid"] for e in ended.values()}) <= 2  # at most two trials at a time, in processes Tune reused
    # each trial's Trainer was built by the subclass's own __init__ (with its argument), in Tune's process
    assert {(tmp_path / "search" / run / "mark").read_text().split()[0] for run in runs} == {"marked"}
    objectives = {trial_id: frame["objective"].iloc[-1] for trial_id, frame in reports.items()}
    assert best.objective == min(objectives.values()) and objectives[best.run_id] == best.objective
    assert best.hyperparameters == next(r.config for r in grid if r.metrics["trial_id"] == best.run_id)
    # the objective is the trial's last evaluation loss (the stopped trial's too): a run with the best
    # hyperparameters scores it again at that step
    again = trainer(
        tmp_path / "again", learning_rate=best.hyperparameters["learning_rate"], seed=int(best.hyperparameters["seed"])
    )
    again.fit()
    evaluations = {h["step"]: h["eval_loss"] for h in again.state.log_history if "eval_loss" in h}
    assert evaluations[reports[best.run_id]["step"].iloc[-1]] == pytest.approx(best.objective, abs=1e-6)


def test_a_trial_reports_once_per_evaluation_and_stops_when_tune_says_so(tmp_path):
    reports: list[dict] = []

    def report(metrics):  # ray.tune.report as Ray runs it: Tune stops the trial at its second report
        reports.append(metrics)
        if len(reports) == 2:
            raise SystemExit(0)

    # two evaluation datasets: one report per evaluation, with both datasets' metrics
    reporter = TuneReport(default_compute_objective, 2, report)
    t = trainer(
        tmp_path,
        callbacks=[reporter, Ended()],
        eval_dataset={"a": regression_data(8, seed=1), "b": regression_data(8, seed=2)},
    )
    t.fit()
    assert [r["step"] for r in reports] == [2, 4] and reporter.stopped and reporter.reported == reports
    assert t.state.global_step == 4 and json.loads((tmp_path / "ended").read_text())["step"] == 4
    for r in reports:
        assert r["objective"] == r["eval_a_loss"] + r["eval_b_loss"] and "epoch" in r
    t.evaluate()  # nothing more goes to a Tune that stopped listening
    assert len(reports) == 2
    with pytest.raises(SystemExit) as exited:  # any other exit is not Tune's stop
        TuneReport(default_compute_objective, 1, lambda m: sys.exit(3)).on_evaluate(
            t.config, t.state, t.control, metrics={}
        )
    assert exited.value.code == 3


def test_the_default_search_space_is_hfs():
    from kiln.engine.hp_search_ray import default_hp_space_ray

    hf_space = pytest.importorskip("transformers.trainer_utils").default_hp_space_ray

    def described(space):  # each distribution: its kind, bounds or categories, and sampler
        return {
            k: (
                type(v).__name__,
                getattr(v, "lower", None),
                getattr(v, "upper", None),
                getattr(v, "categories", None),
                type(v.get_sampler()).__name__,
            )
            for k, v in space.items()
        }

    assert described(default_hp_space_ray(None)) == described(hf_space(None))


def test_a_search_whose_every_trial_failed_says_so_with_the_first_error(monkeypatch, tmp_path):
    class Tuner:  # Ray Tune's, as it ends when every trial raised
        def __init__(self, *args, **kwargs):
            pass

        def fit(self):
            return [SimpleNamespace(error=ValueError("no model")), SimpleNamespace(error=RuntimeError("later"))]

    import ray
    from ray import tune

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # no Ray started: nothing runs
    monkeypatch.setattr(tune, "with_parameters", lambda fn, **kw: fn)
    monkeypatch.setattr(tune, "Tuner", Tuner)
    with pytest.raises(KilnError, match="^every Ray Tune trial failed; the first: ValueError: no model$"):
        trainer(tmp_path).hyperparameter_search(hp_space=lambda _: {}, n_trials=2, backend="ray")


def test_ray_tune_refuses_what_it_cannot_rank(tmp_path):
    t = trainer(tmp_path)
    with pytest.raises(KilnError, match="direction must be 'minimize' or 'maximize'"):
        t.hyperparameter_search(backend="ray", direction=["minimize", "maximize"])
    with pytest.raises(KilnError, match="does not know keep_checkpoints_num"):
        t.hyperparameter_search(backend="ray", keep_checkpoints_num=1)
    with pytest.raises(KilnError, match="kiln searches with optuna or ray"):
        t.hyperparameter_search(backend="sigopt")


def test_a_ray_trial_builds_its_trainer_through_the_subclass_constructor(monkeypatch, tmp_path):
    """`_trial` as Ray Tune runs it in its process (here in this one: the recipe goes through Ray's pickler
    and back, the trial id and `report` are Tune's stand-ins): the trial's Trainer is built by the
    subclass's own __init__, with the trial's values, in `run-<trial id>`."""
    from ray import cloudpickle, tune

    from kiln.engine.hp_search_ray import _recipe, _trial

    reports: list[dict] = []
    monkeypatch.setattr(tune, "get_context", lambda: SimpleNamespace(get_trial_id=lambda: "t0"))
    monkeypatch.setattr(tune, "report", reports.append)
    searching = trainer(tmp_path, callbacks=[Ended()], cls=Marked, cls_kwargs={"mark": "from-init"})
    recipe = cloudpickle.loads(cloudpickle.dumps(_recipe(searching.hp_search.recipe, default_compute_objective, None)))
    _trial({"learning_rate": 0.05, "seed": 7.0}, recipe)
    run = tmp_path / "run-t0"
    assert (run / "mark").read_text() == "from-init 0.05 7"  # Marked.__init__ ran, with the trial's values
    assert json.loads((run / "ended").read_text())["step"] == MAX_STEPS  # the Trainer's own callbacks came along
    assert [r["step"] for r in reports] == [2, 4, 6]
    assert searching.state.global_step == 0 and not (tmp_path / "mark").exists()  # the searching Trainer untouched
