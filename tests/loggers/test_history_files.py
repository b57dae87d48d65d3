"""metrics.csv and metrics.jsonl: what was logged reads back; the CSV header grows; a killed and
resumed run ends with the same files as one that never stopped."""

from __future__ import annotations

import csv
import json
import os

import pytest

from kiln.engine.callbacks.loggers import LoggerCallback
from kiln.loggers.build import build_loggers
from kiln.loggers.csv import CSVLogger
from kiln.loggers.jsonl import JSONLLogger
from tests.loggers.conftest import SEQUENCE, drive, make_config


def read_csv(path):
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        return reader.fieldnames, [{k: float(v) for k, v in row.items() if v != ""} for row in reader]


def read_jsonl(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def expected_rows(sequence=SEQUENCE):
    return [{"step": float(step), **logs} for step, logs in sequence]


def test_csv_reads_back_every_value_and_the_header_grows(config):
    logger = CSVLogger(config)
    logger.log_metrics({"loss": 1.0}, 1)
    assert open(logger.path).read().splitlines() == ["step,loss", "1,1.0"]
    logger.log_metrics({"loss": 0.5, "learning_rate": 1e-3}, 2)  # a new name: header grows, rows kept
    logger.log_metrics({"eval_loss": 0.75}, 2)
    header, rows = read_csv(logger.path)
    assert header == ["step", "loss", "learning_rate", "eval_loss"]
    assert rows == [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 0.5, "learning_rate": 1e-3},
        {"step": 2, "eval_loss": 0.75},
    ]


def test_history_files_through_the_callback(tmp_path):
    cfg = make_config(tmp_path, log={"history": ["csv", "jsonl"]})
    callback = LoggerCallback(cfg, build_loggers(cfg))
    drive(callback, cfg)
    header, rows = read_csv(f"{cfg.output_dir}/runs/metrics.csv")  # under the logging dir, not beside checkpoints
    assert header[:5] == ["step", "loss", "grad_norm", "learning_rate", "epoch"]
    assert rows == expected_rows()
    assert read_jsonl(f"{cfg.output_dir}/runs/metrics.jsonl") == [{"step": s, **logs} for s, logs in SEQUENCE]


def test_history_files_follow_logging_dir(tmp_path):
    cfg = make_config(tmp_path, log={"history": ["csv", "jsonl"], "logging_dir": str(tmp_path / "logs")})
    drive(LoggerCallback(cfg, build_loggers(cfg)), cfg)
    assert read_jsonl(str(tmp_path / "logs" / "metrics.jsonl")) == [{"step": s, **logs} for s, logs in SEQUENCE]
    assert os.path.exists(tmp_path / "logs" / "metrics.csv") and not os.path.exists(f"{cfg.output_dir}/runs")


def test_jsonl_one_object_per_call_with_non_finite_values(config):
    logger = JSONLLogger(config)
    logger.log_metrics({"loss": float("nan"), "grad_norm": float("inf")}, 3)
    logger.log_metrics({"loss": 1.0}, 4)
    logger.flush()  # what the callback does after each batch of records
    lines = open(logger.path).read().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["step"] == 3 and first["loss"] != first["loss"] and first["grad_norm"] == float("inf")


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_kill_and_resume_gives_the_uninterrupted_file(tmp_path, kind):
    """Run A logs everything. Run B logs up to step 4, is 'killed' after logging step 6 (past its
    checkpoint at 4, including a metric name run A only saw later), then a new process resumes from 4."""
    full = make_config(tmp_path / "a", log={"history": [kind]})
    drive(LoggerCallback(full, build_loggers(full)), full)

    killed = make_config(tmp_path / "b", log={"history": [kind]})
    before_kill = SEQUENCE[:5] + [(5, {"loss": 9.0, "late_metric": 1.0}), (6, {"loss": 9.5, "epoch": 0.75})]
    drive(LoggerCallback(killed, build_loggers(killed)), killed, before_kill, end=False)
    resumed = LoggerCallback(killed, build_loggers(killed))  # a new process
    drive(resumed, killed, SEQUENCE[5:], start_step=4)

    name = f"metrics.{kind}"
    assert open(f"{killed.output_dir}/runs/{name}").read() == open(f"{full.output_dir}/runs/{name}").read()


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_a_fresh_start_replaces_a_stale_history_but_keeps_this_process_rows(tmp_path, kind):
    cfg = make_config(tmp_path, log={"history": [kind]})
    drive(LoggerCallback(cfg, build_loggers(cfg)), cfg)  # an earlier job in the same output_dir
    callback = LoggerCallback(cfg, build_loggers(cfg))
    from kiln.engine.callbacks.state import TrainerControl, TrainerState

    callback.on_log(
        cfg, TrainerState(global_step=0), TrainerControl(), logs={"eval_loss": 3.0}
    )  # evaluate() before fit()
    drive(callback, cfg, SEQUENCE[:2])
    path = f"{cfg.output_dir}/runs/metrics.{kind}"
    rows = read_csv(path)[1] if kind == "csv" else [{k: float(v) for k, v in r.items()} for r in read_jsonl(path)]
    assert rows == [{"step": 0, "eval_loss": 3.0}, *expected_rows(SEQUENCE[:2])]


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_a_torn_last_line_is_dropped_before_appending(tmp_path, kind):
    cfg = make_config(tmp_path, log={"history": [kind]})
    drive(LoggerCallback(cfg, build_loggers(cfg)), cfg, SEQUENCE[:2], end=False)
    path = f"{cfg.output_dir}/runs/metrics.{kind}"
    with open(path, "a") as fh:
        fh.write("4,1.5" if kind == "csv" else '{"step": 4, "lo')  # killed mid-write
    drive(LoggerCallback(cfg, build_loggers(cfg)), cfg, SEQUENCE[2:3], start_step=2)
    rows = read_csv(path)[1] if kind == "csv" else read_jsonl(path)
    assert [r["step"] for r in rows] == [1, 2, 2]
