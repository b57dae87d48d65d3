"""LoggerCallback and build_loggers: names, missing packages, what reaches the loggers, import cost."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from omegaconf import read_write

from kiln.engine.callbacks.loggers import LoggerCallback
from kiln.engine.callbacks.state import TrainerControl, TrainerState
from kiln.loggers import TRACKERS
from kiln.loggers.base import Logger, MissingPackageError, flatten, grouped_name
from kiln.loggers.build import artifact_mode, build_loggers, logger_names, scalar_metrics
from kiln.registry import UnknownNameError
from tests.loggers.conftest import SEQUENCE, drive, make_config


class Recorder(Logger):
    name = "recorder"

    def __init__(self, config=None):
        super().__init__(config)
        self.calls: list[tuple] = []

    def log_hyperparams(self, params):
        self.calls.append(("params", dict(params)))

    def log_metrics(self, metrics, step):
        self.calls.append(("metrics", dict(metrics), step))

    def resume(self, step):
        self.calls.append(("resume", step))

    def set_trial(self, name, params):
        self.calls.append(("trial", name))
        super().set_trial(name, params)

    def finalize(self, status):
        self.calls.append(("finalize", status))

    def log_artifact(self, path):
        self.calls.append(("artifact", path))


def test_names_all_none_and_history(tmp_path):
    assert logger_names(make_config(tmp_path)) == []
    assert logger_names(make_config(tmp_path, report_to=["none"], log={"history": ["csv", "jsonl"]})) == [
        "csv",
        "jsonl",
    ]
    both = make_config(tmp_path, report_to=["csv", "tensorboard"], log={"history": ["csv"]})
    assert logger_names(both) == ["csv", "tensorboard"]
    everything = logger_names(make_config(tmp_path, report_to=["all"]))
    assert set(everything) <= set(TRACKERS)


def test_build_loggers_off_rank_zero_and_unknown_names(tmp_path):
    cfg = make_config(tmp_path, report_to=["tensorboard"], log={"history": ["csv"]})
    assert build_loggers(cfg, is_global_zero=False) == []
    assert [lg.name for lg in build_loggers(cfg)] == ["tensorboard", "csv"]
    bad = make_config(tmp_path)
    with read_write(bad):  # past the config's own check of the names, to reach build_loggers'
        bad.log.report_to = ["tensorbord"]
    with pytest.raises(UnknownNameError, match="Did you mean 'tensorboard'"):
        build_loggers(bad)


@pytest.mark.parametrize("name, package", [("tensorboard", "tensorboard"), ("mlflow", "mlflow"), ("wandb", "wandb")])
def test_missing_package_is_one_sentence_with_the_extra(tmp_path, monkeypatch, name, package):
    monkeypatch.setitem(sys.modules, package, None)  # import and find_spec now see no package
    cfg = make_config(tmp_path, report_to=[name], log={"history": ["csv"]})
    with pytest.raises(MissingPackageError) as info:
        build_loggers(cfg)
    message = str(info.value)
    assert f"pip install kiln[{name}]" in message and message.count(".") <= 1 and "\n" not in message
    assert isinstance(info.value, ImportError)
    import os

    assert not os.path.exists(cfg.output_dir)  # nothing was created before failing


def test_two_missing_packages_in_one_message(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingPackageError, match=r"pip install kiln\[mlflow,wandb\]"):
        build_loggers(make_config(tmp_path, report_to=["mlflow", "wandb"]))


def test_all_skips_trackers_that_are_not_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    assert "mlflow" not in logger_names(make_config(tmp_path, report_to=["all"]))


def test_import_kiln_does_not_import_trackers():
    code = (
        "import sys, kiln, kiln.loggers, kiln.loggers.build, kiln.engine.callbacks.loggers, kiln.loggers.metrics, kiln.engine.callbacks.progress, kiln.plot\n"
        "from omegaconf import OmegaConf\n"
        "from kiln.config.schema import TrainingConfig\n"
        "from kiln.loggers.build import build_loggers\n"
        "import tempfile\n"
        "log = {'report_to': ['tensorboard', 'mlflow', 'wandb']}\n"
        "cfg = OmegaConf.merge(OmegaConf.structured(TrainingConfig), {'output_dir': tempfile.mkdtemp(), 'log': log})\n"
        "build_loggers(cfg)\n"
        "names = ('tensorboard', 'mlflow', 'wandb', 'matplotlib', 'torch.utils.tensorboard')\n"
        "heavy = [m for m in names if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_callback_drives_the_logger_life_cycle(tmp_path):
    cfg = make_config(tmp_path, optim={"lr": 0.5})
    rec = Recorder()
    callback = LoggerCallback(cfg, [rec])
    drive(callback, cfg, SEQUENCE[:2], start_step=0)
    kinds = [c[0] for c in rec.calls]
    assert kinds == ["resume", "params", "metrics", "metrics", "finalize"]
    assert rec.calls[0] == ("resume", 0)
    params = rec.calls[1][1]
    assert params["optim.lr"] == 0.5 and params["output_dir"] == cfg.output_dir and "log.report_to" in params
    assert rec.calls[2] == ("metrics", SEQUENCE[0][1], 1) and rec.calls[-1] == ("finalize", "success")
    # fit() again (same run): resumes at the current step, the config is not logged twice
    rec.calls.clear()
    drive(callback, cfg, SEQUENCE[3:4], start_step=2)
    assert [c[0] for c in rec.calls] == ["resume", "metrics", "finalize"] and rec.calls[0] == ("resume", 2)


def test_trials_start_new_runs_with_their_params(tmp_path):
    cfg = make_config(tmp_path)
    rec = Recorder()
    callback = LoggerCallback(cfg, [rec])
    for i in range(2):
        state = TrainerState(max_steps=6, is_hyper_param_search=True, trial_name=f"t{i}", trial_params={"lr": i})
        drive(callback, cfg, SEQUENCE[:1], state=state)
    assert [c for c in rec.calls if c[0] == "trial"] == [("trial", "t0"), ("trial", "t1")]
    assert [c[0] for c in rec.calls].count("params") == 2


def test_only_numbers_reach_the_loggers():
    logs = {
        "loss": 1.5,
        "step_count": 3,
        "flag": True,
        "note": "hi",
        "np": np.float32(0.25),
        "t": torch.tensor(2.0),
        "vec": torch.ones(3),
        "arr": np.ones(2),
        "none": None,
    }
    assert scalar_metrics(logs) == {"loss": 1.5, "step_count": 3, "np": 0.25, "t": 2.0}


def test_artifact_uploads_on_save_and_at_the_end(tmp_path, monkeypatch):
    cfg = make_config(tmp_path)
    for var in ("HF_MLFLOW_LOG_ARTIFACTS", "WANDB_LOG_MODEL"):
        monkeypatch.delenv(var, raising=False)
    assert artifact_mode(cfg, "mlflow") == artifact_mode(cfg, "wandb") == artifact_mode(cfg, "csv") == "false"
    monkeypatch.setenv("HF_MLFLOW_LOG_ARTIFACTS", "TRUE")
    monkeypatch.setenv("WANDB_LOG_MODEL", "end")
    assert artifact_mode(cfg, "mlflow") == "checkpoint" and artifact_mode(cfg, "wandb") == "end"
    assert artifact_mode(cfg, "csv") == "false"

    class Ml(Recorder):
        name = "mlflow"

    class Wb(Recorder):
        name = "wandb"

    ml, wb = Ml(cfg), Wb(cfg)
    callback = LoggerCallback(cfg, [ml, wb])
    import os

    for step in (2, 4):
        os.makedirs(os.path.join(cfg.output_dir, f"checkpoint-{step}"))
    state = drive(callback, cfg, SEQUENCE[:2], end=False)
    state.global_step = 2
    callback.on_save(cfg, state, TrainerControl())
    state.global_step = 4
    state.best_model_checkpoint = os.path.join(cfg.output_dir, "checkpoint-2")
    callback.on_save(cfg, state, TrainerControl())
    callback.on_train_end(cfg, state, TrainerControl())
    assert [c[1] for c in ml.calls if c[0] == "artifact"] == [
        os.path.join(cfg.output_dir, f"checkpoint-{s}") for s in (2, 4)
    ]
    assert [c[1] for c in wb.calls if c[0] == "artifact"] == [state.best_model_checkpoint]


def test_flatten_and_grouped_names():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": 1, "a.c": "[1, 2]", "d": None}
    assert [grouped_name(k) for k in ("loss", "eval_loss", "test_acc", "evaluation")] == [
        "train/loss",
        "eval/loss",
        "test/acc",
        "train/evaluation",
    ]
