"""W&B offline: read the run folder wandb wrote under output_dir/wandb and compare."""

from __future__ import annotations

import os

import pytest

from kiln.engine.callbacks.loggers import LoggerCallback
from kiln.engine.callbacks.state import TrainerState
from kiln.loggers.base import grouped_name
from kiln.loggers.build import build_loggers
from kiln.loggers.wandb import WandbLogger, has_credentials
from tests.installed import requires
from tests.loggers.conftest import SEQUENCE, drive, make_config
from tests.loggers.wandb_reader import offline_runs, read_run

pytestmark = requires("wandb", "pip install kiln[wandb]")


@pytest.fixture(autouse=True)
def offline_env(monkeypatch, tmp_path):
    for name in (
        "WANDB_API_KEY",
        "WANDB_IDENTITY_TOKEN_FILE",
        "WANDB_PROJECT",
        "WANDB_RUN_ID",
        "WANDB_RESUME",
        "WANDB_LOG_MODEL",
        "WANDB_BASE_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    yield monkeypatch
    import wandb

    if wandb.run is not None:
        wandb.finish()
    wandb.teardown()  # wandb keeps the first test's environment in a process-wide singleton


def rows(run):
    return [{k: v for k, v in row.items() if not k.startswith("_")} for row in run["history"]]


def test_offline_run_through_the_callback(tmp_path):
    cfg = make_config(tmp_path, report_to=["wandb"], optim={"lr": 3e-4})
    callback = LoggerCallback(cfg, build_loggers(cfg))
    drive(callback, cfg)
    [folder] = offline_runs(cfg.output_dir)
    run = read_run(folder)
    assert run["name"] == "unit-run" and run["project"] == "kiln" and run["exit_code"] == 0
    expected = [{**{grouped_name(k): v for k, v in logs.items()}, "train/global_step": step} for step, logs in SEQUENCE]
    assert rows(run) == expected
    assert run["config"]["optim.lr"] == 3e-4 and run["config"]["log.report_to"] == "['wandb']"


def test_no_credentials_means_offline_never_a_prompt(tmp_path, offline_env, caplog):
    offline_env.delenv("WANDB_MODE")
    assert not has_credentials()
    cfg = make_config(tmp_path)
    logger = WandbLogger(cfg)
    logger.log_metrics({"loss": 1.0}, 5)
    assert logger.run.settings.mode == "offline"
    logger.finalize("failed")
    [folder] = offline_runs(cfg.output_dir)
    run = read_run(folder)
    assert rows(run) == [{"train/loss": 1.0, "train/global_step": 5}] and run["exit_code"] == 1
    assert "no API key" in caplog.text


def test_credentials_from_env_or_netrc(tmp_path, offline_env):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "a" * 40 + "\n")
    netrc.chmod(0o600)
    offline_env.setenv("NETRC", str(netrc))
    assert has_credentials()
    offline_env.setenv("NETRC", str(tmp_path / "none"))
    offline_env.setenv("WANDB_API_KEY", "b" * 40)
    assert has_credentials()


def test_trials_are_separate_runs_grouped_by_run_name(tmp_path):
    cfg = make_config(tmp_path, report_to=["wandb"])
    callback = LoggerCallback(cfg, build_loggers(cfg))
    for i in range(2):
        state = TrainerState(max_steps=6, is_hyper_param_search=True, trial_name=f"trial-{i}", trial_params={"lr": i})
        drive(callback, cfg, [(1, {"loss": float(i)})], state=state)
    runs = [read_run(f) for f in offline_runs(cfg.output_dir)]
    assert sorted(r["name"] for r in runs) == ["trial-0", "trial-1"]
    assert {r["group"] for r in runs} == {"unit-run"}
    for r in runs:
        i = int(r["name"][-1])
        assert rows(r) == [{"train/loss": float(i), "train/global_step": 1}] and r["config"]["lr"] == i


def test_a_run_the_caller_started_receives_the_logs(tmp_path):
    import wandb

    cfg = make_config(tmp_path, report_to=["wandb"])
    outer = wandb.init(project="mine", dir=str(tmp_path))
    drive(LoggerCallback(cfg, build_loggers(cfg)), cfg, SEQUENCE[:1])
    assert wandb.run is outer  # still open: the caller finishes it
    outer.finish()
    assert not os.path.exists(os.path.join(cfg.output_dir, "wandb"))
    [folder] = offline_runs(str(tmp_path))
    assert rows(read_run(folder))[0]["train/loss"] == 2.5


def test_a_crashed_job_finishes_its_run_as_failed(tmp_path):
    """The exit hook finishes the run before W&B's own hook tears its service down."""
    import subprocess
    import sys

    out = tmp_path / "out"
    code = f"""
from omegaconf import OmegaConf
from kiln.config.schema import TrainingConfig
from kiln.engine.callbacks.state import TrainerControl, TrainerState
from kiln.engine.callbacks.loggers import LoggerCallback
from kiln.loggers.build import build_loggers
cfg = OmegaConf.merge(OmegaConf.structured(TrainingConfig),
                      {{"output_dir": {str(out)!r}, "log": {{"report_to": ["wandb"], "history": []}}}})  # no torch import
callback = LoggerCallback(cfg, build_loggers(cfg))
state = TrainerState(max_steps=5)
callback.on_train_begin(cfg, state, TrainerControl())
state.global_step = 1
callback.on_log(cfg, state, TrainerControl(), logs={{"loss": 1.0}})
raise RuntimeError("boom")
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert result.returncode == 1 and "boom" in result.stderr
    assert "Exception ignored in atexit" not in result.stderr
    [folder] = offline_runs(str(out))
    run = read_run(folder)
    assert run["exit_code"] == 1 and rows(run) == [{"train/loss": 1, "train/global_step": 1}]
