"""Documented precision names that YAML and the command line turn into numbers or booleans before
kiln sees them (`16`, `32`, `no`) still pick their plugin."""

from __future__ import annotations

import pytest

from kiln.config import ConfigError, load_config


@pytest.mark.parametrize(
    "source, overrides, name",
    [
        ({"precision": 16}, [], "16"),
        ({"precision": {"name": 16}}, [], "16"),
        (None, ["precision=16"], "16"),
        (None, ["precision.name=16"], "16"),
        ({"precision": {"name": False}}, [], "no"),
        (None, ["precision.name=no"], "no"),
    ],
)
def test_precision_aliases_from_yaml_numbers_and_booleans(source, overrides, name):
    assert load_config(source, overrides).precision.name == name


def test_precision_aliases_32_and_no_from_yaml_and_cli(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("precision: no\n")  # YAML 1.1: a bare `no` is False
    assert load_config(str(path)).precision.name == "no"
    assert load_config(None, ["precision=no"]).precision.name == "no"
    assert load_config({"precision": 32}).precision.name == "32"
    with pytest.raises(ConfigError, match=r"^Config key 'precision' takes a name \(e.g. bf16 or 16\) or a mapping"):
        load_config({"precision": True})
