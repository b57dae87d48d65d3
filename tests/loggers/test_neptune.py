"""Neptune offline: the operations Neptune queued for `neptune sync` (NEPTUNE_DATA_DIRECTORY), read
back with Neptune's own operation classes."""

from __future__ import annotations

import glob
import json
import os

import pytest

pytest.importorskip("neptune", reason="pip install kiln[neptune]")

from tests.loggers.tracker_parity import Read, assert_same, no_network, train  # noqa: E402,F401


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
