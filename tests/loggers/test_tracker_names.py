"""The trackers beyond TensorBoard, MLflow and W&B, by name: HF's `report_to` names, each one sentence
naming its extra when its package is missing, and `all` picking the installed ones."""

from __future__ import annotations

import os
import sys

import pytest

from kiln.loggers import LOGGERS, TRACKERS
from kiln.loggers.base import MissingPackageError
from kiln.loggers.build import build_loggers, logger_names
from tests.loggers.conftest import make_config

# report_to name -> (package, extra)
NEW = {
    "comet_ml": ("comet_ml", "comet"),
    "clearml": ("clearml", "clearml"),
    "dvclive": ("dvclive", "dvclive"),
    "aim": ("aim", "aim"),
    "trackio": ("trackio", "trackio"),
    "swanlab": ("swanlab", "swanlab"),
    "codecarbon": ("codecarbon", "codecarbon"),
    "neptune": ("neptune", "neptune"),
}


def test_every_hf_tracker_name_is_known():
    assert set(NEW) <= set(LOGGERS.names()) and set(NEW) <= set(TRACKERS)


@pytest.mark.parametrize("name", sorted(NEW))
def test_missing_package_is_one_sentence_with_the_extra(tmp_path, monkeypatch, name):
    package, extra = NEW[name]
    monkeypatch.setitem(sys.modules, package, None)  # import and find_spec now see no package
    cfg = make_config(tmp_path, report_to=[name])
    with pytest.raises(MissingPackageError) as info:
        build_loggers(cfg)
    message = str(info.value)
    assert (
        message == f"report_to: {name} needs the `{package}` package, which is not installed: pip install kiln[{extra}]"
    )
    assert info.value.extra == extra and not os.path.exists(cfg.output_dir)
    assert name not in logger_names(make_config(tmp_path, report_to=["all"]))


def test_two_missing_name_their_extras(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "comet_ml", None)
    monkeypatch.setitem(sys.modules, "neptune", None)
    with pytest.raises(
        MissingPackageError, match=r"report_to: comet_ml, neptune need .*pip install kiln\[comet,neptune\]$"
    ):
        build_loggers(make_config(tmp_path, report_to=["comet_ml", "neptune"]))


def test_all_means_every_installed_tracker(tmp_path, monkeypatch):
    import importlib.util

    installed = [t for t in TRACKERS if importlib.util.find_spec(t) is not None]
    assert logger_names(make_config(tmp_path, report_to=["all"])) == installed
