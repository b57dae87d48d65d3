"""What the Ray tests share (test_ray_train.py, test_ray_tune.py, test_ray_output_once.py): one local Ray
instance for the package, started by the first test that asks for it and stopped after the last test of
tests/launch (starting Ray costs seconds on 2 cores; the modules run one after the other, in one xdist
worker), and one `kiln fit --ray 2` run that two of them check (a Ray Train run costs a minute on 2 cores)."""

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
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}},
        )
        yield ray
        ray.shutdown()


@pytest.fixture(scope="package")
def ray_fsdp_run(local_ray, tmp_path_factory):
    """`kiln fit --ray 2 strategy.name=fsdp` with a final evaluation: (output_dir, marks folder).
    test_ray_train.py compares its weights with one process; test_ray_output_once.py reads what its
    workers printed."""
    from kiln import cli
    from tests.launch.ray_toy import write_config

    root = tmp_path_factory.mktemp("ray_fsdp")
    folder, out = root / "marks", root / "run"
    folder.mkdir()
    assert (
        cli.main(
            [
                "fit",
                write_config(root / "c.yaml", out, folder=str(folder), eval_rows=8),
                "--ray",
                "2",
                "strategy.name=fsdp",
            ]
        )
        == 0
    )
    return out, folder
