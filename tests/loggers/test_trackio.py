"""Trackio, local: its project database, read back with Trackio's own SQLiteStorage."""

from __future__ import annotations

import os
import tempfile

import pytest

# Trackio fixes its folder when imported: a private one for this module, before the import.
os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="kiln-trackio-"))
pytest.importorskip("trackio", reason="pip install kiln[trackio]")

from kiln.engine.callbacks.loggers import LoggerCallback  # noqa: E402
from kiln.loggers.build import build_loggers  # noqa: E402
from tests.loggers.conftest import make_config  # noqa: E402
from tests.loggers.tracker_parity import Read, assert_same, no_network, train, trials  # noqa: E402,F401


def read(project: str, run: str) -> Read:
    from trackio.sqlite_storage import SQLiteStorage

    metrics: dict[str, list] = {}
    for row in SQLiteStorage.get_logs(project, run):
        for key, value in row.items():
            if key not in ("timestamp", "step", "train/global_step"):
                metrics.setdefault(key, []).append((row["step"], value))
        assert row["train/global_step"] == row["step"]
    config = SQLiteStorage.get_run_config(project, run)
    return Read(run, metrics, {k: v for k, v in config.items() if not k.startswith("_")})


def test_a_run_holds_what_tensorboard_holds(tmp_path, monkeypatch, no_network):
    from trackio.sqlite_storage import SQLiteStorage

    project = f"kiln-{os.path.basename(tmp_path)}"
    out = train(
        tmp_path, monkeypatch, "trackio", log={"steps": 2, "history": [], "disable_tqdm": True, "project": project}
    )
    [run] = SQLiteStorage.get_runs(project)
    assert_same(read(project, run), out)


def test_trials_are_runs_grouped_by_run_name(tmp_path):
    from trackio.sqlite_storage import SQLiteStorage

    project = f"trials-{os.path.basename(tmp_path)}"
    cfg = make_config(tmp_path, report_to=["trackio"], log={"project": project})
    trials(LoggerCallback(cfg, build_loggers(cfg)), cfg)
    assert sorted(SQLiteStorage.get_runs(project)) == ["trial-0", "trial-1"]
    for i in range(2):
        got = read(project, f"trial-{i}")
        assert got.metrics == {"train/loss": [(1, float(i))]} and got.params["lr"] == i
        assert SQLiteStorage.get_run_config(project, f"trial-{i}")["_Group"] == "unit-run"
