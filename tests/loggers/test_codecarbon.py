"""CodeCarbon: the row its offline tracker appends to output_dir/emissions.csv."""

from __future__ import annotations

import csv
import os

import pytest

pytest.importorskip("codecarbon", reason="pip install kiln[codecarbon]")

from tests.loggers.tracker_parity import MASKED, SECRET, no_network, tensorboard, train  # noqa: E402,F401


def test_training_is_measured_under_the_run_name(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("CODECARBON_COUNTRY_ISO_CODE", "FRA")  # CodeCarbon's own setting, read by CodeCarbon
    out = train(tmp_path, monkeypatch, "codecarbon")
    with open(os.path.join(out, "emissions.csv"), newline="") as fh:
        [row] = list(csv.DictReader(fh))
    assert row["project_name"] == MASKED == tensorboard(out).name and SECRET not in open(os.path.join(out, "emissions.csv")).read()
    assert float(row["duration"]) > 0 and float(row["energy_consumed"]) > 0 and row["country_iso_code"] == "FRA"
