"""ClearML offline: the session folder ClearML writes under its cache (CLEARML_CACHE_DIR), read back
from its task and metrics files."""

from __future__ import annotations

import glob
import json
import os

import pytest

from kiln.engine.callbacks.loggers import LoggerCallback
from kiln.loggers.build import build_loggers
from tests.installed import requires
from tests.loggers.conftest import make_config
from tests.loggers.tracker_parity import Read, assert_same, no_network, train, trials  # noqa: F401

pytestmark = requires("clearml", "pip install kiln[clearml]")


#: ClearML reports from a subprocess on Linux, which flushes every 5 s and which `Task.close` waits for:
#: ~6 s per task here, idle. Its thread mode writes the same offline session, at once.
CONFIG = "sdk { development { report_use_subprocess: false } }\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    (tmp_path / "clearml.conf").write_text(CONFIG)
    monkeypatch.setenv(
        "CLEARML_CONFIG_FILE", str(tmp_path / "clearml.conf")
    )  # read when ClearML first loads its config
    monkeypatch.setenv("CLEARML_CACHE_DIR", str(tmp_path / "clearml-cache"))
    return tmp_path / "clearml-cache"


def read(session: str) -> Read:
    task = json.load(open(os.path.join(session, "task.json")))
    # a parameter ClearML stored without a type is one it could not type: None
    params = {p["name"]: p["value"] if "type" in p else None for p in task["hyperparams"]["kiln"].values()}
    metrics: dict[str, list] = {}
    with open(os.path.join(session, "metrics.jsonl")) as fh:
        for line in fh:
            for event in json.loads(line):
                if event["type"] == "training_stats_scalar":
                    metrics.setdefault(f"{event['metric']}/{event['variant']}", []).append(
                        (event["iter"], event["value"])
                    )
    return Read(task["name"], metrics, params)


def test_a_run_holds_what_tensorboard_holds(tmp_path, monkeypatch, cache, no_network):
    out = train(
        tmp_path, monkeypatch, "clearml", log={"steps": 2, "history": [], "disable_tqdm": True, "project": "mine"}
    )
    [session] = [d for d in glob.glob(str(cache / "offline" / "*")) if os.path.isdir(d)]
    assert os.path.exists(session + ".zip")  # what Task.import_offline_session uploads
    assert_same(read(session), out)
    assert json.load(open(os.path.join(session, "task.json")))["project_name"] == "mine"


def test_trials_are_tasks_of_their_own(tmp_path, cache):
    cfg = make_config(tmp_path, report_to=["clearml"])
    callback = LoggerCallback(cfg, build_loggers(cfg))
    trials(callback, cfg)
    runs = sorted((read(d) for d in glob.glob(str(cache / "offline" / "*")) if os.path.isdir(d)), key=lambda r: r.name)
    assert [(r.name, r.params["lr"], r.metrics) for r in runs] == [
        (f"trial-{i}", str(i), {"train/loss": [(1, float(i))]}) for i in range(2)
    ]
