"""Precision given as a number in a Python dict config means what it means in Lightning (issue 30,
item 4): 32 is fp32, 16 is fp16 mixed, and the strings keep working; 64 (Lightning's double precision)
is refused by name."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from kiln import Trainer
from kiln.utils.errors import ConfigError, PrecisionError


def _plugin(value: Any, tmp_path: Any) -> str:
    """The name of the plugin the Trainer builds for `{"precision": value}`."""
    try:
        return Trainer(torch.nn.Linear(2, 2), {"output_dir": str(tmp_path), "precision": value}).precision.name
    except PrecisionError as err:  # fp16 on a CPU without fp16 kernels: refused naming the plugin it picked
        picked = re.match(r"precision '([\w-]+)' needs", str(err))
        assert picked, str(err)
        return picked.group(1)


@pytest.mark.parametrize(
    "value, plugin",
    [
        (32, "fp32"),
        (32.0, "fp32"),
        ("32", "fp32"),
        ("32-true", "fp32"),
        (16, "fp16"),
        ("16", "fp16"),
        ("16-mixed", "fp16"),
        ("bf16", "bf16"),
        ("bf16-mixed", "bf16"),
        ("bf16-true", "bf16-true"),
        ("16-true", "fp16-true"),
    ],
)
def test_precision_value_in_a_dict_config_picks_lightnings_plugin(value: Any, plugin: str, tmp_path: Any) -> None:
    assert _plugin(value, tmp_path) == plugin


@pytest.mark.parametrize("value", [64, "64", "64-true"])
def test_double_precision_is_refused_by_name(value: Any, tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match=r"^Unknown precision plugin '64(-true)?' in `precision.name`"):
        _plugin(value, tmp_path)


@pytest.mark.parametrize("value, plugin", [(32, "fp32"), ("bf16", "bf16"), ("bf16-true", "bf16-true")])
def test_precision_keyword_given_as_a_name_or_number(value: Any, plugin: str, tmp_path: Any) -> None:
    """`Trainer(..., precision="bf16")` names the plugin as the config would (it beats the config's)."""
    trainer = Trainer(torch.nn.Linear(2, 2), {"output_dir": str(tmp_path), "precision": "fp32"}, precision=value)
    assert trainer.precision.name == plugin
