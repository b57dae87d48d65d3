"""DVCLive: output_dir/dvclive, read back with DVCLive's own readers (its tsv and yaml parsers)."""

from __future__ import annotations

import glob
import os

import pytest

pytest.importorskip("dvclive", reason="pip install kiln[dvclive]")
from dvclive.serialize import load_yaml  # noqa: E402
from dvclive.utils import parse_json, parse_tsv  # noqa: E402

from kiln.engine.callbacks.loggers import LoggerCallback  # noqa: E402
from kiln.loggers.build import build_loggers  # noqa: E402
from kiln.loggers.dvclive import DVCLiveLogger  # noqa: E402
from tests.loggers.conftest import SEQUENCE, drive, make_config  # noqa: E402
from tests.loggers.tracker_parity import Read, assert_same, grouped_name, no_network, train, trials  # noqa: E402,F401


@pytest.fixture(autouse=True)
def outside_git(tmp_path, monkeypatch):
    """DVCLive's Live() runs `dvc init` in the git repository holding the working directory (and, with
    experiments on, commits to it): run from a folder that is in none, and check it stays untouched."""
    monkeypatch.chdir(tmp_path)
    yield
    assert not os.path.exists(tmp_path / ".dvc")


def read(folder: str) -> Read:
    plots = os.path.join(folder, "plots", "metrics")
    metrics = {}
    for path in glob.glob(os.path.join(plots, "**", "*.tsv"), recursive=True):
        name = os.path.relpath(path, plots)[: -len(".tsv")]
        metrics[name] = [(int(row["step"]), float(row[os.path.basename(name)])) for row in parse_tsv(path)]
    path = os.path.join(folder, "params.yaml")
    params = load_yaml(path) if os.path.exists(path) else {}
    return Read(params.get("run_name", ""), metrics, params)


def test_a_run_holds_what_tensorboard_holds(tmp_path, monkeypatch, no_network):
    out = train(tmp_path, monkeypatch, "dvclive")
    folder = os.path.join(out, "dvclive")
    tb = assert_same(read(folder), out)
    latest = parse_json(os.path.join(folder, "metrics.json"))  # the summary: each metric's last value
    assert latest["train"]["loss"] == pytest.approx(tb.metrics["train/loss"][-1][1], rel=1e-6)
    assert latest["eval"]["loss"] == pytest.approx(tb.metrics["eval/loss"][-1][1], rel=1e-6)
    assert sorted(os.listdir(folder)) == [
        "metrics.json",
        "params.yaml",
        "plots",
    ]  # no dvc.yaml, report or system metrics


def test_resume_drops_what_the_killed_job_wrote_after_the_checkpoint(tmp_path):
    cfg = make_config(tmp_path, report_to=["dvclive"])
    killed = SEQUENCE[:5] + [(5, {"loss": 9.0}), (6, {"loss": 9.5})]
    drive(LoggerCallback(cfg, build_loggers(cfg)), cfg, killed, end=False)
    drive(LoggerCallback(cfg, build_loggers(cfg)), cfg, SEQUENCE[5:], start_step=4)
    got = read(os.path.join(cfg.output_dir, "dvclive"))
    for name in {k for _, logs in SEQUENCE for k in logs}:
        assert got.metrics[grouped_name(name)] == [
            (s, v) for s, logs in SEQUENCE for k, v in logs.items() if k == name
        ], name


def test_a_fresh_run_replaces_and_evaluate_after_fit_continues(tmp_path):
    cfg = make_config(tmp_path, report_to=["dvclive"])
    drive(LoggerCallback(cfg, build_loggers(cfg)), cfg, [(3, {"loss": 9.0})])
    logger = DVCLiveLogger(cfg)
    logger.resume(0)  # a new job in the same output_dir, from scratch
    logger.log_metrics({"loss": 0.5}, 1)
    logger.finalize("success")
    logger.log_metrics({"eval_loss": 0.25}, 1)  # evaluate() after fit()
    logger.finalize("success")
    assert read(os.path.join(cfg.output_dir, "dvclive")).metrics == {"train/loss": [(1, 0.5)], "eval/loss": [(1, 0.25)]}


def test_trials_get_their_own_folders(tmp_path):
    cfg = make_config(tmp_path, report_to=["dvclive"])
    trials(LoggerCallback(cfg, build_loggers(cfg)), cfg)
    for i in range(2):
        got = read(os.path.join(cfg.output_dir, "dvclive", f"trial-{i}"))
        assert got.metrics == {"train/loss": [(1, float(i))]} and got.params["lr"] == i
