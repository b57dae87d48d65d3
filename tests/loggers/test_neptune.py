"""Neptune offline: the operations Neptune queued for `neptune sync` (NEPTUNE_DATA_DIRECTORY), read
back with Neptune's own operation classes."""

from __future__ import annotations

import glob
import json
import os

from kiln.engine.callbacks.loggers import LoggerCallback
from kiln.loggers.build import build_loggers
from kiln.loggers.neptune import NeptuneLogger
from tests.installed import requires
from tests.loggers.conftest import make_config
from tests.loggers.tracker_parity import Read, assert_same, no_network, train, trials  # noqa: F401

pytestmark = requires("neptune", "pip install kiln[neptune]")


def read(run_dir: str) -> Read:
    from neptune.internal.operation import Operation  # Neptune's own decoder of its queue

    name, metrics, params = "", {}, {}
    for path in sorted(glob.glob(os.path.join(run_dir, "data-*.log"))):
        with open(path) as fh:
            for line in fh:
                op = Operation.from_dict(json.loads(line)["obj"])
                kind, where = type(op).__name__, "/".join(op.path)
                if kind == "LogFloats":
                    metrics.setdefault(where, []).extend((int(v.step), v.value) for v in op.values)
                elif op.path[0] == "parameters":
                    params["/".join(op.path[1:])] = op.value
                elif where == "sys/name":
                    name = op.value
    return Read(name, metrics, params)


def test_a_run_holds_what_tensorboard_holds(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("NEPTUNE_DATA_DIRECTORY", str(tmp_path / "neptune"))
    out = train(tmp_path, monkeypatch, "neptune")
    [run_dir] = glob.glob(str(tmp_path / "neptune" / "offline" / "run__*"))
    assert_same(read(run_dir), out)
    paths = set()
    for path in glob.glob(os.path.join(run_dir, "data-*.log")):
        with open(path) as fh:
            paths |= {json.loads(line)["obj"]["path"][0] for line in fh}
    assert "monitoring" not in paths  # no console, traceback or hardware capture


def test_trials_and_a_failed_run(tmp_path, monkeypatch):
    monkeypatch.setenv("NEPTUNE_DATA_DIRECTORY", str(tmp_path / "neptune"))
    cfg = make_config(tmp_path, report_to=["neptune"])
    trials(LoggerCallback(cfg, build_loggers(cfg)), cfg)
    found = sorted((read(d) for d in glob.glob(str(tmp_path / "neptune" / "offline" / "run__*"))), key=lambda r: r.name)
    assert [(r.name, r.params["lr"], r.metrics) for r in found] == [
        (f"trial-{i}", i, {"train/loss": [(1, float(i))]}) for i in range(2)
    ]
    monkeypatch.setenv("NEPTUNE_DATA_DIRECTORY", str(tmp_path / "failed"))
    logger = NeptuneLogger(cfg)
    logger.log_metrics({"loss": 1.0}, 1)
    logger.finalize("failed")
    [run_dir] = glob.glob(str(tmp_path / "failed" / "offline" / "run__*"))
    assert failed(run_dir) is True and not any(
        failed(d) for d in glob.glob(str(tmp_path / "neptune" / "offline" / "run__*"))
    )


def failed(run_dir: str) -> bool:
    """The last `sys/failed` the run assigned."""
    value = None
    for path in sorted(glob.glob(os.path.join(run_dir, "data-*.log"))):
        with open(path) as fh:
            for line in fh:
                obj = json.loads(line)["obj"]
                if obj["path"] == ["sys", "failed"]:
                    value = obj["value"]
    return value
