"""`torch.distributed.checkpoint` (DCP) folders as kiln reads them, for every strategy that writes one
(the mesh strategy's `fsdp_dcp/`, XLA SPMD's `xla_dcp/`): a folder's full weights read in one process without a
process group (`kiln convert`), and the optimizer's param-group layout read from its metadata. Every
pickle in a folder is vetted before DCP reads it (kiln.utils.safe_pickle)."""

from __future__ import annotations

import os
from typing import Any

import torch

from kiln.utils.errors import CheckpointError
from kiln.utils.param_groups import regroup_optimizer_state
from kiln.utils.safe_pickle import dcp_load_error, vet_dcp_folder, weights_only_refusal


def consolidate(directory: str, subdir: str) -> dict[str, torch.Tensor]:
    """The full model weights of a sharded checkpoint (the DCP folder `subdir` in it), read in this
    process without a process group (any number of processes may have saved it)."""
    return model_tensors(read_folder(directory, subdir), os.path.join(directory, subdir))


def read_folder(directory: str, subdir: str) -> dict[str, Any]:
    """Everything the DCP folder `subdir` of a checkpoint holds (its model and, when saved, its optimizer
    state), whole, read in this process without a process group."""
    from torch.distributed.checkpoint import CheckpointException, FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = os.path.join(directory, subdir)
    if not os.path.isdir(path):
        raise CheckpointError(f"{directory} has no {subdir}/ folder, so it is not a sharded checkpoint of that kind.")
    vet_dcp_folder(path)  # DCP unpickles .metadata and non-tensor entries unchecked: vet them first
    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True
        )
    except (Exception, CheckpointException) as err:  # DCP's own type is a BaseException
        if weights_only_refusal(err):
            raise dcp_load_error(path, err, False) from None
        raise CheckpointError(
            f"{path} cannot be read ({(str(err) or type(err).__name__).splitlines()[0][:300]})."
        ) from None
    return state


def model_tensors(state: dict[str, Any], path: str) -> dict[str, torch.Tensor]:
    """The model weights of a DCP folder's state as `read_folder` returns it."""
    model = state.get("model")
    if not isinstance(model, dict):
        raise CheckpointError(f"{path} holds no model weights.")
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def saved_group_count(metadata: Any) -> int | None:
    """How many optimizer param groups a DCP checkpoint holds, from its (vetted) metadata (None: no
    optimizer state; dcp.load then reports what is wrong)."""
    keys = metadata.state_dict_metadata
    indices = {key.split(".")[2] for key in keys if key.startswith("optim.param_groups.")}
    return len(indices) or None


def regrouped(saved: Any, groups: Any, path: str) -> Any:
    """`saved` optimizer state in the running optimizer's param-group layout (kiln.utils.param_groups)."""
    try:
        return regroup_optimizer_state(saved, groups)
    except ValueError as err:
        raise CheckpointError(f"The optimizer state in {path} does not fit this optimizer ({err}).") from None
