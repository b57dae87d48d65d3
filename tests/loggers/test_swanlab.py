"""SwanLab offline: the run's record file under output_dir/swanlog, read back with SwanLab's own
DataStoreReader and record protos (what `swanlab sync` uploads), and its config.yaml."""

from __future__ import annotations

import glob
import os

import pytest
import yaml

pytest.importorskip("swanlab", reason="pip install kiln[swanlab]")

from tests.loggers.tracker_parity import Read, assert_same, no_network, train  # noqa: E402,F401


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
