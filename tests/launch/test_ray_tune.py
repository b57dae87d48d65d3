"""`Trainer.hyperparameter_search(backend="ray")` (issue 32 item 1), as HF's Ray Tune backend: a
4-trial search on a local Ray instance, each trial a kiln fit of its own in Ray Tune's process (its
files in output_dir/run-<trial id>), and the best trial returned as a `BestRun`."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import Trainer
from kiln.engine.hp_search import BestRun
from kiln.utils.errors import KilnError
from tests.distributed.toy import Regressor, regression_data

ray = pytest.importorskip("ray", reason="pip install 'kiln[ray]'")
tune = pytest.importorskip("ray.tune")

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def model_init(trial=None) -> Regressor:
    return Regressor()


def trainer(output_dir, **extra) -> Trainer:
    config = {"output_dir": str(output_dir), "max_steps": 4, "per_device_train_batch_size": 8, "report_to": "none",
              "disable_tqdm": True, "save_strategy": "no", "seed": 1, "strategy": {"name": "single", "device": "cpu"}, **extra}
    return Trainer(None, config, model_init=model_init, train_dataset=regression_data(32), eval_dataset=regression_data(16, seed=1))


@pytest.mark.heavy  # four trials in Ray Tune's processes: over the Ray tests' CI budget on 2 cores
def test_a_four_trial_ray_tune_search_returns_the_best_run(local_ray, tmp_path):
    t = trainer(tmp_path / "search")
    best = t.hyperparameter_search(hp_space=lambda _: {"learning_rate": tune.loguniform(1e-4, 1e-1), "seed": tune.uniform(1, 40)},
                                   n_trials=4, direction="minimize", backend="ray")
    assert isinstance(best, BestRun)
    grid = best.run_summary
    assert len(grid) == 4 and not grid.errors
    objectives = {r.metrics["trial_id"]: r.metrics["objective"] for r in grid}
    assert best.objective == min(objectives.values()) and objectives[best.run_id] == best.objective
    assert best.hyperparameters == next(r.config for r in grid if r.metrics["trial_id"] == best.run_id)
    # each trial was a kiln fit of its own, in its own folder, with its (integer) seed
    runs = sorted(p.name for p in (tmp_path / "search").iterdir() if p.name.startswith("run-"))
    assert runs == sorted(f"run-{trial_id}" for trial_id in objectives)
    # the objective is the trial's evaluation loss: a run with the best hyperparameters scores it again
    again = trainer(tmp_path / "again", learning_rate=best.hyperparameters["learning_rate"],
                    seed=int(best.hyperparameters["seed"]))
    again.fit()
    assert again.evaluate()["eval_loss"] == pytest.approx(best.objective, abs=1e-6)


def test_ray_tune_refuses_what_it_cannot_rank(tmp_path):
    t = trainer(tmp_path)
    with pytest.raises(KilnError, match="direction must be 'minimize' or 'maximize'"):
        t.hyperparameter_search(backend="ray", direction=["minimize", "maximize"])
    with pytest.raises(KilnError, match="does not know keep_checkpoints_num"):
        t.hyperparameter_search(backend="ray", keep_checkpoints_num=1)
    with pytest.raises(KilnError, match="kiln searches with optuna or ray"):
        t.hyperparameter_search(backend="sigopt")
