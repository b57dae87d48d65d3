"""What the Ray tests share (test_ray_train.py, test_ray_tune.py, test_ray_output_once.py): one local Ray
instance for the package, started by the first test that asks for it and stopped after the last test of
tests/launch (starting Ray costs seconds on 2 cores; the modules run one after the other, in one xdist
worker), and one `kiln fit --ray 2` run with a restart that two of them check (a Ray Train run costs a
minute on 2 cores: test_ray_train.py reads its weights and checkpoints, test_ray_output_once.py what its
workers printed)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: Ray Train's controller polls its workers every 2 s (a report waits for the poll, and so do the end of
#: a run and the notice of a dead worker): 0.2 s here. No pre-emption watcher (one process fewer). A
#: worker group may take longer than Ray's 60 s to start on 2 busy cores (pytest -n 2): 300 s.
RAY_TRAIN_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300",
}


@pytest.fixture(scope="package")
def local_ray():
    """`ray.init(num_cpus=2)` without the dashboard; Ray's processes import the tests' task code from
    the repository and use one thread each."""
    ray = pytest.importorskip("ray", reason="pip install 'kiln[ray]'")
    with pytest.MonkeyPatch.context() as env:  # Ray Train hands these from the driver to its controller and workers
        for key, value in RAY_TRAIN_ENV.items():
            env.setenv(key, value)
        _start(ray)
        yield ray
        ray.shutdown()


def _start(ray) -> None:  # type: ignore[no-untyped-def]
    """Ray's raylet waits a fixed ~30 s for its agents' port files and aborts past it ("Timed out waiting
    for file .../metrics_agent_port_..."), which 2 cores shared with another test worker, the lint and
    CI's background build can exceed at the suite's start: one more start, from nothing, after such an
    abort. Ray's own start-up, not kiln, is what is retried; every test still runs on a live cluster."""
    settings = {
        "num_cpus": 2,
        "include_dashboard": False,
        "log_to_driver": False,
        "runtime_env": {"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}},
    }
    try:
        ray.init(**settings)
    except Exception:  # noqa: BLE001 -- whatever Ray raises when its raylet aborted during start-up
        ray.shutdown()
        ray.init(**settings)


@pytest.fixture(scope="package")
def ray_restarted_run(local_ray, tmp_path_factory):
    """DDP in 2 Ray workers (`launcher: {max_failures: 1, num_to_keep: 2, checkpoint_score_attribute:
    loss}`), rank 1 killed at step DIE_STEP of the first attempt, with a final evaluation (it leaves the
    weights as they are): (output_dir, marks folder, Ray's Result)."""
    from kiln.cli import train_loop_per_worker
    from kiln.config.load import load_config
    from kiln.launch.ray import RayLaunch, launch_ray
    from tests.launch.ray_toy import DIE_STEP, write_config

    root = tmp_path_factory.mktemp("ray_ddp")
    folder, out = root / "marks", root / "run"
    folder.mkdir()
    cfg_path = write_config(root / "c.yaml", out, folder=str(folder), die_rank=1, die_step=DIE_STEP, eval_rows=8)
    overrides = ["launcher.max_failures=1", "launcher.num_to_keep=2", "launcher.checkpoint_score_attribute=loss"]
    launch = RayLaunch.from_config(load_config(cfg_path, overrides), num_workers=2)
    return out, folder, launch_ray([cfg_path], launch, train_loop_per_worker)
