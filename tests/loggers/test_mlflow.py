"""MLflow: read back with `mlflow.tracking.MlflowClient` from the store the logger wrote.

A fresh MLflow sqlite store takes ~8 s to create (schema migrations), so one store is created per
session and copied where a test needs a new one."""

from __future__ import annotations

import os
import shutil

import pytest

from kiln.engine.callbacks.loggers import LoggerCallback
from kiln.engine.callbacks.state import TrainerState
from kiln.loggers.build import build_loggers
from kiln.loggers.mlflow import MLflowLogger, metric_key
from tests.installed import requires
from tests.loggers.conftest import SEQUENCE, drive, expected_points, make_config

pytestmark = requires("mlflow", "pip install kiln[mlflow]")


def MlflowClient(tracking_uri: str):  # noqa: N802 -- MLflow's class, imported when a test reads a store
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


@pytest.fixture(scope="session")
def template_db(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlflow")
    path = folder / "template.db"
    cwd = os.getcwd()
    os.chdir(folder)  # the store puts its Default experiment's artifacts under ./mlruns: keep them here
    try:
        MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    finally:
        os.chdir(cwd)
    return path


@pytest.fixture
def clean_env(monkeypatch):
    for name in (
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_RUN_ID",
        "MLFLOW_NESTED_RUN",
        "MLFLOW_TAGS",
        "HF_MLFLOW_LOG_ARTIFACTS",
    ):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    import mlflow

    while mlflow.active_run():
        mlflow.end_run()


@pytest.fixture
def store(tmp_path, template_db, clean_env):
    """A tracking store the caller configured through MLFLOW_TRACKING_URI."""
    path = tmp_path / "tracking.db"
    shutil.copy(template_db, path)
    uri = f"sqlite:///{path}"
    clean_env.setenv("MLFLOW_TRACKING_URI", uri)
    return MlflowClient(tracking_uri=uri)


def history(client, run_id, name):
    return [
        (m.step, m.value) for m in sorted(client.get_metric_history(run_id, name), key=lambda m: (m.step, m.timestamp))
    ]


def test_local_store_in_output_dir_through_the_callback(tmp_path, template_db, clean_env):
    cfg = make_config(tmp_path, report_to=["mlflow"], optim={"lr": 3e-4})
    os.makedirs(cfg.output_dir)
    shutil.copy(template_db, os.path.join(cfg.output_dir, "mlflow.db"))  # skip the 8 s schema creation
    callback = LoggerCallback(cfg, build_loggers(cfg))
    drive(callback, cfg)
    client = MlflowClient(tracking_uri=f"sqlite:///{cfg.output_dir}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("kiln").experiment_id])
    assert run.info.run_name == "unit-run" and run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith("file://" + os.path.abspath(cfg.output_dir) + "/mlruns/")
    names = {k for _, logs in SEQUENCE for k in logs}
    assert set(run.data.metrics) == names
    for name in names:
        assert history(client, run.info.run_id, name) == expected_points(name), name
    assert run.data.params["optim.lr"] == "0.0003" and run.data.params["log.report_to"] == "['mlflow']"
    assert run.data.tags["kiln.output_dir"] == os.path.abspath(cfg.output_dir)


def test_params_are_truncated_and_batched(tmp_path, store):
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    args = {f"k{i}": i for i in range(150)} | {"blob": "x" * (MAX_PARAM_VAL_LENGTH + 50)}
    cfg = make_config(tmp_path, report_to=["mlflow"], task={"model_args": args})
    drive(LoggerCallback(cfg, build_loggers(cfg)), cfg, SEQUENCE[:1])
    [run] = store.search_runs([store.get_experiment_by_name("Default").experiment_id])
    params = run.data.params
    assert len(params) > 200  # more than one batch of 100
    assert params["task.model_args.blob"] == "x" * MAX_PARAM_VAL_LENGTH
    assert params["task.model_args.k149"] == "149"


def test_direct_use_artifacts_and_failed_status(tmp_path, store):
    cfg = make_config(tmp_path, report_to=["mlflow"])
    logger = MLflowLogger(cfg)
    logger.log_metrics({"loss": 1.0, "eval_f1@0.5": 0.5}, 3)
    model = tmp_path / "final"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "note.txt").write_text("hi")
    logger.log_artifact(str(model))
    logger.log_artifact(str(tmp_path / "note.txt"))
    logger.finalize("failed")
    run = store.get_run(logger.run_id)
    assert run.info.status == "FAILED"
    assert history(store, logger.run_id, "loss") == [(3, 1.0)]
    assert (
        history(store, logger.run_id, metric_key("eval_f1@0.5")) == [(3, 0.5)]
        and metric_key("eval_f1@0.5") == "eval_f1_0.5"
    )
    assert {a.path for a in store.list_artifacts(logger.run_id)} == {"final", "note.txt"}
    assert [a.path for a in store.list_artifacts(logger.run_id, "final")] == ["final/model.safetensors"]


def test_checkpoints_uploaded_when_asked(tmp_path, store, clean_env):
    clean_env.setenv("HF_MLFLOW_LOG_ARTIFACTS", "1")
    cfg = make_config(tmp_path, report_to=["mlflow"])
    callback = LoggerCallback(cfg, build_loggers(cfg))
    ckpt = os.path.join(cfg.output_dir, "checkpoint-2")
    os.makedirs(ckpt)
    open(os.path.join(ckpt, "trainer_state.json"), "w").write("{}")
    from kiln.engine.callbacks.state import TrainerControl

    state = drive(callback, cfg, SEQUENCE[:2], end=False)
    state.global_step = 2
    callback.on_save(cfg, state, TrainerControl())
    callback.finalize("success")
    run_id = callback.loggers[0].run_id
    assert [a.path for a in store.list_artifacts(run_id)] == ["checkpoint-2"]


def test_active_run_receives_logs_or_a_nested_child(tmp_path, store, clean_env):
    import mlflow

    cfg = make_config(tmp_path, report_to=["mlflow"])
    with mlflow.start_run(run_name="outer") as outer:
        drive(LoggerCallback(cfg, build_loggers(cfg)), cfg, SEQUENCE[:1])
        assert mlflow.active_run().info.run_id == outer.info.run_id  # the caller's run stays open
        clean_env.setenv("MLFLOW_NESTED_RUN", "true")
        nested = LoggerCallback(cfg, build_loggers(cfg))
        drive(nested, cfg, SEQUENCE[1:2])
    assert history(store, outer.info.run_id, "loss") == [(1, 2.5)]
    child = store.get_run(nested.loggers[0].run_id)
    assert child.data.tags["mlflow.parentRunId"] == outer.info.run_id
    assert history(store, child.info.run_id, "loss") == [(2, 2.0)] and child.info.status == "FINISHED"


def test_trials_are_child_runs_of_one_search_run(tmp_path, store):
    cfg = make_config(tmp_path, report_to=["mlflow"])
    callback = LoggerCallback(cfg, build_loggers(cfg))
    ids = []
    for i in range(2):
        state = TrainerState(max_steps=6, is_hyper_param_search=True, trial_name=f"trial-{i}", trial_params={"lr": i})
        drive(callback, cfg, [(1, {"loss": float(i)})], state=state)
        ids.append(callback.loggers[0].run_id)
    runs = [store.get_run(i) for i in ids]
    parents = {r.data.tags["mlflow.parentRunId"] for r in runs}
    assert len(set(ids)) == 2 and len(parents) == 1
    assert [r.info.run_name for r in runs] == ["trial-0", "trial-1"]
    assert [r.data.params["lr"] for r in runs] == ["0", "1"]
    assert store.get_run(parents.pop()).info.run_name == "unit-run"
