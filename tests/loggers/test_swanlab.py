"""SwanLab offline: the run's record file under output_dir/swanlog, read back with SwanLab's own
DataStoreReader and record protos (what `swanlab sync` uploads), and its config.yaml."""

from __future__ import annotations

import glob
import json
import os

import pytest
import yaml

pytest.importorskip("swanlab", reason="pip install kiln[swanlab]")

from kiln.engine.callbacks.loggers import LoggerCallback  # noqa: E402
from kiln.loggers.build import build_loggers  # noqa: E402
from kiln.loggers.swanlab import SwanLabLogger  # noqa: E402
from tests.loggers.conftest import make_config  # noqa: E402
from tests.loggers.tracker_parity import Read, assert_same, no_network, train, trials  # noqa: E402,F401


def read(run_dir: str) -> Read:
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    reader = DataStoreReader()
    [path] = glob.glob(os.path.join(run_dir, "run-*.swanlab"))
    reader.open(path)
    name, metrics, kinds = "", {}, set()
    for data in reader:
        record = Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        kinds.add(kind)
        if kind == "start":
            name = record.start.name
        elif kind == "scalar":
            metrics.setdefault(record.scalar.key, []).append((record.scalar.step, record.scalar.value.number))
    reader.close()
    assert "log" not in kinds  # no console capture
    with open(os.path.join(run_dir, "files", "config.yaml")) as fh:
        params = {k: v["value"] for k, v in yaml.safe_load(fh).items()}
    return Read(name, metrics, params)


def test_a_run_holds_what_tensorboard_holds(tmp_path, monkeypatch, no_network):
    out = train(tmp_path, monkeypatch, "swanlab")
    [run_dir] = glob.glob(os.path.join(out, "swanlog", "run-*"))
    assert_same(read(run_dir), out, one_per_step=True)  # SwanLab keeps one value per step
    assert not os.path.exists(os.path.join(run_dir, "files", "requirements.txt"))  # probes off
    with open(os.path.join(run_dir, "files", "swanlab-metadata.json")) as fh:
        metadata = json.load(fh)
    assert metadata["hardware"] is None and metadata["runtime"] is None and metadata["git"] is None


def test_trials_and_a_failed_run(tmp_path):
    cfg = make_config(tmp_path, report_to=["swanlab"])
    callback = LoggerCallback(cfg, build_loggers(cfg))
    trials(callback, cfg)
    found = sorted((read(d) for d in glob.glob(os.path.join(cfg.output_dir, "swanlog", "run-*"))), key=lambda r: r.name)
    assert [(r.name, r.params["lr"], r.metrics) for r in found] == [
        (f"trial-{i}", i, {"train/loss": [(1, float(i))]}) for i in range(2)
    ]
    logger = SwanLabLogger(make_config(tmp_path / "failed"))
    logger.log_metrics({"loss": 1.0}, 1)
    logger.finalize("failed")
    [run_dir] = glob.glob(os.path.join(tmp_path / "failed", "out", "swanlog", "run-*"))
    assert finish_state(run_dir) == "RUN_STATE_CRASHED" and finish_state(found_dir(cfg)) == "RUN_STATE_FINISHED"


def finish_state(run_dir: str) -> str:
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    reader = DataStoreReader()
    [path] = glob.glob(os.path.join(run_dir, "run-*.swanlab"))
    reader.open(path)
    states = []
    for data in reader:
        record = Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "finish":
            states.append(
                type(record.finish)
                .DESCRIPTOR.fields_by_name["state"]
                .enum_type.values_by_number[record.finish.state]
                .name
            )
    reader.close()
    return states[-1]


def found_dir(cfg) -> str:
    return sorted(glob.glob(os.path.join(cfg.output_dir, "swanlog", "run-*")))[0]
