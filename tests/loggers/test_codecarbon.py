"""CodeCarbon: the row its offline tracker appends to output_dir/emissions.csv."""

from __future__ import annotations

import csv
import os

from kiln.engine.callbacks.loggers import LoggerCallback
from kiln.loggers.build import build_loggers
from tests.installed import requires
from tests.loggers.conftest import make_config
from tests.loggers.tracker_parity import MASKED, SECRET, no_network, tensorboard, train, trials  # noqa: F401

pytestmark = requires("codecarbon", "pip install kiln[codecarbon]")


def test_training_is_measured_under_the_run_name(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("CODECARBON_COUNTRY_ISO_CODE", "FRA")  # CodeCarbon's own setting, read by CodeCarbon
    out = train(tmp_path, monkeypatch, "codecarbon")
    with open(os.path.join(out, "emissions.csv"), newline="") as fh:
        [row] = list(csv.DictReader(fh))
    assert (
        row["project_name"] == MASKED == tensorboard(out).name
        and SECRET not in open(os.path.join(out, "emissions.csv")).read()
    )
    assert float(row["duration"]) > 0 and float(row["energy_consumed"]) > 0 and row["country_iso_code"] == "FRA"


def test_each_trial_is_a_row(tmp_path):
    cfg = make_config(tmp_path, report_to=["codecarbon"])
    trials(LoggerCallback(cfg, build_loggers(cfg)), cfg)
    with open(os.path.join(cfg.output_dir, "emissions.csv"), newline="") as fh:
        assert [row["project_name"] for row in csv.DictReader(fh)] == ["trial-0", "trial-1"]
