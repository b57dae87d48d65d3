"""Local rank 0 of a second node is a "main process" for its node (it logs at log_level and, with
save_on_each_node, writes checkpoints), but never a tracker owner: it opens no TensorBoard / MLflow /
W&B run and writes no history or metrics files. One process stands in for global rank 1 = local rank
0 of node 1; the same run as global rank 0 is the control that writes every file."""

from __future__ import annotations

import glob
import os

import pytest

from kiln import Trainer
from kiln.engine.callbacks.loggers import LoggerCallback
from kiln.strategies.single import SingleDeviceStrategy
from tests.helpers import TinyRegressor, regression_data

TRACKERS = ["tensorboard", "mlflow", "wandb", "csv", "jsonl"]


class LocalZeroOfSecondNode(SingleDeviceStrategy):
    """Global rank 1 of 2, local rank 0, node 1 (a one-process stand-in: collectives are identities,
    so it trains on its half of the data alone)."""

    world_size, global_rank, local_rank, node_rank = 2, 1, 0, 1


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """Trackers offline and local; the working folder is tmp_path, so stray ./mlruns or ./wandb show."""
    for name in (
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_RUN_ID",
        "WANDB_API_KEY",
        "WANDB_PROJECT",
        "WANDB_RUN_ID",
        "WANDB_DIR",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _config(out: str, report_to: list[str], **extra):
    return {
        "output_dir": out,
        "run_name": "node-test",
        "max_steps": 4,
        "learning_rate": 1e-2,
        "per_device_train_batch_size": 4,
        "report_to": report_to,
        "log_on_each_node": True,
        "log": {"steps": 2, "history": ["csv", "jsonl"], "disable_tqdm": True},
        "eval": {"strategy": "steps", "steps": 2},
        "save": {"strategy": "steps", "steps": 4, "on_each_node": True},
        "strategy": {"device": "cpu"},
        **extra,
    }


def _run(out: str, report_to: list[str], strategy=None) -> Trainer:
    trainer = Trainer(
        TinyRegressor(),
        _config(out, report_to),
        train_dataset=regression_data(32),
        eval_dataset=regression_data(8, seed=1),
        strategy=strategy,
    )
    out_metrics = trainer.fit().metrics
    trainer.log_metrics("train", out_metrics)
    trainer.save_metrics("train", out_metrics)
    trainer.save_state()
    return trainer


def test_local_rank_zero_of_node_one_opens_no_tracker_and_writes_no_history(sandbox, capsys):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    import mlflow
    import wandb

    out = str(sandbox / "node1")
    trainer = _run(out, TRACKERS, strategy=LocalZeroOfSecondNode)
    assert not trainer.is_world_process_zero() and trainer.is_local_process_zero()
    # save_on_each_node: this node's checkpoint is its only output
    assert sorted(os.listdir(out)) == ["checkpoint-4"]
    assert os.listdir(sandbox) == ["node1"]  # no ./mlruns, ./wandb or tmp_trainer either
    assert mlflow.active_run() is None and wandb.run is None
    assert not [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, LoggerCallback)]
    assert "train metrics" not in capsys.readouterr().out  # log_metrics prints on global rank 0 only


def test_global_rank_zero_writes_them_all(sandbox, capsys):
    """The control: the same config on global rank 0 writes every history and tracker file (the
    trackers that need a service are checked to be built, without opening their runs here)."""
    from kiln.loggers.build import build_loggers, logger_names

    out = str(sandbox / "node0")
    trainer = _run(out, ["tensorboard"])
    files = set(os.listdir(out))
    assert {"train_results.json", "all_results.json", "trainer_state.json", "checkpoint-4", "runs"} <= files
    assert {"metrics.csv", "metrics.jsonl"} <= set(os.listdir(os.path.join(out, "runs")))  # the logging dir
    assert len(glob.glob(os.path.join(out, "runs", "*", "events.out.tfevents.*"))) == 1
    assert "train metrics" in capsys.readouterr().out
    assert logger_names(trainer.config) == ["tensorboard", "csv", "jsonl"]
    full = Trainer(TinyRegressor(), _config(str(sandbox / "unused"), TRACKERS), train_dataset=regression_data(8)).config
    assert [type(lg).__name__ for lg in build_loggers(full)] == [
        "TensorBoardLogger",
        "MLflowLogger",
        "WandbLogger",
        "CSVLogger",
        "JSONLLogger",
    ]
