"""The param-group count check before DeepSpeed loads its optimizer state, on hand-made files: which
optimizer's groups it counts, and a file that records none."""

from __future__ import annotations

import os
import types

import pytest
import torch

from kiln.strategies.deepspeed.checkpoint_io import TAG, _check_group_count
from kiln.utils.errors import CheckpointError
from tests.installed import requires

pytestmark = requires("deepspeed")


def _folder(tmp_path, state):
    os.makedirs(tmp_path / TAG)
    torch.save(state, tmp_path / TAG / "mp_rank_00_model_states.pt")
    return str(tmp_path)


def _optimizer(groups):
    return types.SimpleNamespace(param_groups=[{"params": []} for _ in range(groups)])


def test_the_groups_of_the_optimizer_deepspeed_wraps_are_counted(tmp_path):
    folder = _folder(tmp_path, {"param_shapes": [{}, {}]})  # ZeRO: one shape record per group
    # ZeRO's own wrapper may group differently; the user's (basic) optimizer is what the checkpoint matches
    _check_group_count(folder, types.SimpleNamespace(basic_optimizer=_optimizer(2), optimizer=_optimizer(1)))
    with pytest.raises(CheckpointError, match="2 parameter groups and this run's optimizer has 1"):
        _check_group_count(folder, types.SimpleNamespace(basic_optimizer=None, optimizer=_optimizer(1)))


def test_a_file_that_records_no_groups_is_left_to_deepspeed(tmp_path):
    folder = _folder(tmp_path, {"module": {}})  # neither ZeRO's param_shapes nor a plain optimizer state
    _check_group_count(folder, types.SimpleNamespace(basic_optimizer=None, optimizer=_optimizer(2)))


def test_a_plain_optimizer_state_is_counted(tmp_path):
    folder = _folder(tmp_path, {"optimizer": {"param_groups": [{}]}})  # ZeRO-0 keeps the torch optimizer's state
    with pytest.raises(CheckpointError, match="resume with the kiln version that saved it"):
        _check_group_count(folder, types.SimpleNamespace(basic_optimizer=None, optimizer=_optimizer(2)))


def test_an_engine_without_an_optimizer_is_not_checked(tmp_path):
    folder = _folder(tmp_path, {"param_shapes": [{}, {}]})  # an engine set up without an optimizer
    _check_group_count(folder, types.SimpleNamespace(basic_optimizer=None, optimizer=None))
    _check_group_count(str(tmp_path / "empty"), types.SimpleNamespace(basic_optimizer=None, optimizer=_optimizer(1)))
