"""Comet offline: the experiment archive under output_dir/comet, read back from its messages file."""

from __future__ import annotations

import glob
import json
import os
import zipfile

from kiln.engine.callbacks.loggers import LoggerCallback
from kiln.loggers.build import build_loggers
from kiln.loggers.comet import CometLogger
from tests.installed import requires
from tests.loggers.conftest import make_config
from tests.loggers.tracker_parity import Read, assert_same, no_network, train, trials  # noqa: F401

pytestmark = requires("comet_ml", "pip install kiln[comet]")

# what Comet adds by itself to every offline experiment
_OWN = {"process duration"}


def read(path: str) -> Read:
    """One offline archive: Comet's messages, one JSON object per line."""
    name, metrics, params = "", {}, {}
    with zipfile.ZipFile(path) as archive:
        for line in archive.read("messages.json").decode().splitlines():
            message = json.loads(line)
            payload = message["payload"]
            if message["type"] == "metric_msg" and payload["metric"]["metricName"] not in _OWN:
                m = payload["metric"]
                metrics.setdefault(m["metricName"], []).append((m["step"], m["metricValue"]))
            elif message["type"] == "parameter_msg" and payload["param"]["source"] == "manual":
                params[payload["param"]["paramName"]] = payload["param"]["paramValue"]
            elif message["type"] == "log_other" and payload["key"] == "Name":
                name = payload["value"]
    return Read(name, metrics, params)


def archives(output_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(output_dir, "comet", "*.zip")), key=os.path.getmtime)


def test_a_run_holds_what_tensorboard_holds(tmp_path, monkeypatch, no_network):
    out = train(tmp_path, monkeypatch, "comet_ml")
    [archive] = archives(out)
    assert_same(read(archive), out)
    meta = json.loads(zipfile.ZipFile(archive).read("experiment.json"))
    assert meta["project_name"] == "kiln"


def test_evaluate_after_fit_continues_the_experiment(tmp_path):
    cfg = make_config(tmp_path, log={"project": "mine"})
    logger = CometLogger(cfg)
    logger.capture()
    logger.log_metrics({"loss": 0.5}, 7)
    logger.finalize("success")
    logger.log_metrics({"eval_loss": 0.25}, 8)  # evaluate() after fit()
    logger.finalize("success")
    first, second = archives(cfg.output_dir)
    assert read(first).metrics == {"train/loss": [(7, 0.5)]} and read(second).metrics == {"eval/loss": [(8, 0.25)]}
    keys = [json.loads(zipfile.ZipFile(a).read("experiment.json"))["offline_id"] for a in (first, second)]
    assert keys[0] == keys[1] == logger.key
    assert json.loads(zipfile.ZipFile(first).read("experiment.json"))["project_name"] == "mine"


def test_import_switches_off_comets_own_capture(tmp_path, monkeypatch):
    monkeypatch.delenv("COMET_DISABLE_AUTO_LOGGING", raising=False)
    monkeypatch.setenv("COMET_ERROR_TRACKING_ENABLE", "true")  # the user's own setting wins
    CometLogger(make_config(tmp_path)).capture()
    assert os.environ["COMET_DISABLE_AUTO_LOGGING"] == "1" and os.environ["COMET_ERROR_TRACKING_ENABLE"] == "true"


def test_trials_are_experiments_of_their_own(tmp_path):
    cfg = make_config(tmp_path, report_to=["comet_ml"])
    callback = LoggerCallback(cfg, build_loggers(cfg))
    trials(callback, cfg)
    runs = sorted((read(a) for a in archives(cfg.output_dir)), key=lambda r: r.name)
    assert [(r.name, r.params["lr"], r.metrics) for r in runs] == [
        (f"trial-{i}", i, {"train/loss": [(1, float(i))]}) for i in range(2)
    ]
    assert all(
        json.loads(zipfile.ZipFile(a).read("experiment.json"))["tags"] == ["unit-run"] for a in archives(cfg.output_dir)
    )
