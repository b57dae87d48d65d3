"""Whether history files are written when `log.history` is unset (issue 30 item 7): with `report_to:
none` (HF's default) kiln writes nothing under output_dir/runs, as HF writes nothing there; a tracker
in report_to brings csv + jsonl along; an explicit `log.history` decides alone."""

from __future__ import annotations

import pytest

from kiln.config import load_config
from kiln.loggers.build import history_names, logger_names


@pytest.mark.parametrize(
    "settings, names",
    [
        ({}, []),  # the default: report_to none
        ({"report_to": "none"}, []),
        ({"report_to": []}, []),
        ({"report_to": "tensorboard"}, ["tensorboard", "csv", "jsonl"]),
        ({"report_to": "none", "log": {"history": ["csv", "jsonl"]}}, ["csv", "jsonl"]),
        ({"report_to": "none", "log": {"history": ["jsonl"]}}, ["jsonl"]),
        ({"report_to": "tensorboard", "log": {"history": []}}, ["tensorboard"]),
    ],
)
def test_which_loggers_a_config_gets(tmp_path, settings, names):
    cfg = load_config({"output_dir": str(tmp_path), **settings})
    assert logger_names(cfg) == names
    assert history_names(cfg) == [n for n in names if n in ("csv", "jsonl")]


def test_report_to_none_leaves_no_runs_folder(tmp_path):
    from kiln import Trainer
    from tests.helpers import TinyRegressor, regression_data

    out = tmp_path / "out"
    trainer = Trainer(
        TinyRegressor(),
        {"output_dir": str(out), "max_steps": 2, "logging_steps": 1, "disable_tqdm": True, "save_strategy": "no"},
        train_dataset=regression_data(16),
    )
    trainer.fit()
    assert [e for e in trainer.state.log_history if "loss" in e]  # it did log, to log_history only
    assert not (out / "runs").exists()
