"""Checkpoints of `strategy: model_parallel` (format "model-parallel-dcp"): one
`torch.distributed.checkpoint` folder `model_parallel_dcp/` holding the model and the optimizer, each
rank writing its own shards (FSDP's dp shards and TP's splits are both DTensor shards, which DCP
records with their global offsets).

DCP reshards on load, so a checkpoint saved on one mesh resumes on another (tp 2 -> dp_shard 2 -> one
process: the mesh is not part of the format), and `kiln convert` reads the full weights in one process
without a process group. `load_weights_only` also reads a plain exported model folder."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch import nn

from kiln.strategies.checkpoint_io import CheckpointIO, register_format
from kiln.strategies.fsdp.checkpoint_io import _regrouped, _saved_group_count, consolidate, load_plain_weights
from kiln.utils.errors import CheckpointError
from kiln.utils.safe_pickle import dcp_load_error, vet_dcp_folder

DCP_DIR = "model_parallel_dcp"


@register_format
class ModelParallelCheckpointIO(CheckpointIO):
    format = "model-parallel-dcp"
    reshardable = True
    sharded = True

    def __init__(self, strategy: Any = None) -> None:
        self.strategy = strategy

    @classmethod
    def consolidate(cls, directory: str) -> dict[str, torch.Tensor]:
        return consolidate(directory, DCP_DIR)  # vets the folder's pickles before DCP reads them

    def save(self, directory: str, *, model: nn.Module, module: nn.Module, optimizer: Optional[torch.optim.Optimizer],
             save_optimizer: bool, safetensors: bool, writer: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {"model": get_model_state_dict(module)}
        if save_optimizer and optimizer is not None:
            state["optim"] = get_optimizer_state_dict(module, optimizer)
        dcp.save(state, checkpoint_id=os.path.join(directory, DCP_DIR))  # collective: every rank writes its shards

    def load(self, directory: str, *, model: nn.Module, module: nn.Module, optimizer: Optional[torch.optim.Optimizer],
             load_optimizer: bool = True) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        path = os.path.join(directory, DCP_DIR)
        with_optim = load_optimizer and optimizer is not None
        if not os.path.isdir(path):
            if with_optim:
                raise CheckpointError(f"{path} is missing: {directory} is not a model_parallel checkpoint; resume with "
                                      "the strategy that saved it.")
            return load_plain_weights(directory, module)  # an exported model folder
        metadata = vet_dcp_folder(path)  # DCP unpickles .metadata and non-tensor entries unchecked: vet them first
        state: dict[str, Any] = {"model": get_model_state_dict(module)}
        if with_optim:
            state["optim"] = get_optimizer_state_dict(module, optimizer)
            groups = state["optim"]["param_groups"]
            saved_groups = _saved_group_count(metadata)
            if saved_groups and saved_groups != len(groups):  # the other param-group layout: load its groups whole
                state["optim"]["param_groups"] = [dict(groups[0]) for _ in range(saved_groups)]
        try:
            dcp.load(state, checkpoint_id=path)  # into this mesh's shards, whatever mesh saved them
        except (Exception, dcp.CheckpointException) as err:  # the latter is a BaseException
            raise dcp_load_error(path, err, with_optim) from None
        set_model_state_dict(module, state["model"])
        if with_optim:
            set_optimizer_state_dict(module, optimizer, _regrouped(state["optim"], groups, path))
