"""Two things a user reads when auto-wrap does not do what they asked: the refusal of an unknown wrap
class lists the model's classes that could be units (those holding parameters or submodules, not
parameterless leaves such as Dropout or activations), and a block left out because it shares a
parameter with a module outside it is logged by name (otherwise it silently becomes part of the root unit)."""

from __future__ import annotations

import logging

import pytest
from torch import nn

from kiln.strategies.wrap_policy import blocks_to_wrap
from kiln.utils.errors import ConfigError


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.1)
        self.act = nn.GELU()


class Net(nn.Module):
    _no_split_modules = ["Layer"]

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.head = nn.Linear(4, 2)


def test_the_refusal_lists_classes_with_parameters_or_children_only():
    with pytest.raises(ConfigError) as err:
        blocks_to_wrap(Net(), ["Block"], None)
    listed = str(err.value).split("its module classes are: ", 1)[1].rstrip(".").split(", ")
    assert listed == ["Layer", "Linear", "ModuleList"]


def test_a_block_left_to_its_parent_for_a_tie_is_logged(caplog):
    model = Net()
    with caplog.at_level(logging.INFO, logger="kiln.strategies.wrap_policy"):
        assert len(blocks_to_wrap(model, None, None)) == 2
    assert "shares parameters" not in caplog.text
    model.layers[1].proj.weight = model.layers[0].proj.weight  # tied across the two layers
    with caplog.at_level(logging.INFO, logger="kiln.strategies.wrap_policy"):
        assert blocks_to_wrap(model, None, None) == []
    assert "FSDP: layers.0 (Layer) shares parameters with modules outside it" in caplog.text
    assert "FSDP: layers.1 (Layer) shares parameters with modules outside it" in caplog.text
