"""FSDP checkpoints, in kiln's `checkpoint-<step>/` folder.

- `sharded` (default, format "fsdp-sharded"): a `torch.distributed.checkpoint` folder `fsdp_dcp/`
  holding the model and the optimizer, each rank writing its own shard. DCP reshards on load, so a
  checkpoint saved by N processes resumes on M (also on 1), and `kiln convert` turns it into one
  model.safetensors without any process group.
- `full` (format "fsdp-full"): the weights gathered to rank 0 and written as model.safetensors,
  the optimizer state gathered into optimizer.pt (keyed by parameter name).

Both loaders also read a plain exported model folder (model.safetensors / pytorch_model.bin) for
`load_weights_only`."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch import nn

from kiln.strategies.checkpoint_io import (OPTIMIZER, CheckpointIO, apply_weights, load_weights, register_format,
                                           save_weights)
from kiln.utils.errors import CheckpointError, safe_torch_load
from kiln.utils.param_groups import regroup_optimizer_state
from kiln.utils.safe_pickle import dcp_load_error, vet_dcp_folder, weights_only_refusal

DCP_DIR = "fsdp_dcp"


def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def full_model_state(module: nn.Module, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """The gathered weights on CPU: on rank 0 only (the others get {}), or on every rank."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if every_rank:
        state = get_model_state_dict(module, options=_options(full_state_dict=True))
        return {k: v.detach().cpu() for k, v in state.items()}
    return get_model_state_dict(module, options=_options(full_state_dict=True, cpu_offload=True))


def set_full_model_state(module: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load full (unsharded) weights into the sharded module; each rank keeps its shard."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    _check_keys(module, state, source)
    set_model_state_dict(module, state, options=_options(full_state_dict=True))


def _check_keys(module: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """The names and shapes must fit; reuse the plain loader's one-sentence message on a mismatch."""
    own = module.state_dict()
    shapes_ok = all(tuple(state[k].shape) == tuple(_full_shape(v)) for k, v in own.items() if k in state)
    if set(own) != set(state) or not shapes_ok:
        shell = {k: torch.empty(_full_shape(v), device="meta") for k, v in own.items()}
        probe = _Probe(shell)
        apply_weights(probe, state, source)  # raises CheckpointError naming the keys


def _saved_group_count(metadata: Any) -> Optional[int]:
    """How many optimizer param groups a DCP checkpoint holds, from its (vetted) metadata (None: no
    optimizer state; dcp.load then reports what is wrong)."""
    keys = metadata.state_dict_metadata
    indices = {key.split(".")[2] for key in keys if key.startswith("optim.param_groups.")}
    return len(indices) or None


def _regrouped(saved: Any, groups: Any, path: str) -> Any:
    """`saved` optimizer state in the running optimizer's param-group layout (kiln.utils.param_groups)."""
    try:
        return regroup_optimizer_state(saved, groups)
    except ValueError as err:
        raise CheckpointError(f"The optimizer state in {path} does not fit this optimizer ({err}).") from None


def _full_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)  # a DTensor's shape is already the full (global) shape


class _Probe(nn.Module):
    """A module whose state_dict is a given name -> shape map (for the mismatch message)."""

    def __init__(self, shell: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._shell = shell

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self._shell


def load_plain_weights(directory: str, module: nn.Module) -> None:
    """An exported model folder or a `full` checkpoint: read on every rank, shard into `module`."""
    set_full_model_state(module, load_weights(directory), directory)


@register_format
class ShardedFSDPCheckpointIO(CheckpointIO):
    format = "fsdp-sharded"
    reshardable = True
    sharded = True

    def __init__(self, strategy: Any = None) -> None:
        self.strategy = strategy

    @classmethod
    def consolidate(cls, directory: str) -> dict[str, torch.Tensor]:
        return consolidate(directory)  # vets the DCP folder's pickles first

    def save(self, directory: str, *, model: nn.Module, module: nn.Module, optimizer: Optional[torch.optim.Optimizer],
             save_optimizer: bool, safetensors: bool, writer: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {"model": get_model_state_dict(module)}
        if save_optimizer and optimizer is not None:
            state["optim"] = get_optimizer_state_dict(module, optimizer)
        dcp.save(state, checkpoint_id=os.path.join(directory, DCP_DIR))  # collective: every rank writes its shard

    def load(self, directory: str, *, model: nn.Module, module: nn.Module, optimizer: Optional[torch.optim.Optimizer],
             load_optimizer: bool = True) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        path = os.path.join(directory, DCP_DIR)
        if not os.path.isdir(path):
            if load_optimizer and optimizer is not None:
                raise CheckpointError(f"{path} is missing: {directory} is not a sharded FSDP checkpoint; resume with "
                                      "the strategy and state_dict_type that saved it.")
            return load_plain_weights(directory, module)
        metadata = vet_dcp_folder(path)  # DCP unpickles .metadata and non-tensor entries unchecked: vet them first
        state: dict[str, Any] = {"model": get_model_state_dict(module)}
        with_optim = load_optimizer and optimizer is not None
        if with_optim:
            state["optim"] = get_optimizer_state_dict(module, optimizer)
            groups = state["optim"]["param_groups"]
            saved_groups = _saved_group_count(metadata)
            if saved_groups and saved_groups != len(groups):  # the other param-group layout: load its groups whole
                state["optim"]["param_groups"] = [dict(groups[0]) for _ in range(saved_groups)]
        try:
            dcp.load(state, checkpoint_id=path)
        except (Exception, dcp.CheckpointException) as err:  # the latter is a BaseException
            raise dcp_load_error(path, err, with_optim) from None
        set_model_state_dict(module, state["model"])
        if with_optim:
            set_optimizer_state_dict(module, optimizer, _regrouped(state["optim"], groups, path))

    def load_weights_only(self, directory: str, *, model: nn.Module, module: nn.Module) -> None:
        self.load(directory, model=model, module=module, optimizer=None, load_optimizer=False)


@register_format
class FullFSDPCheckpointIO(ShardedFSDPCheckpointIO):
    format = "fsdp-full"
    reshardable = True
    sharded = False

    @classmethod
    def consolidate(cls, directory: str) -> dict[str, torch.Tensor]:
        return load_weights(directory)

    def save(self, directory: str, *, model: nn.Module, module: nn.Module, optimizer: Optional[torch.optim.Optimizer],
             save_optimizer: bool, safetensors: bool, writer: bool) -> None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        weights = full_model_state(module, every_rank=writer and not self.strategy.is_global_zero)
        optim = None
        if save_optimizer and optimizer is not None:  # collective: every rank takes part
            optim = get_optimizer_state_dict(module, optimizer, options=_options(full_state_dict=True, cpu_offload=True))
        if writer and self.strategy.is_global_zero:
            save_weights(weights, directory, safetensors)
            if optim is not None:
                torch.save(optim, os.path.join(directory, OPTIMIZER))
        elif writer:  # another node's local rank 0 (save.on_each_node) writes the weights it gathered
            save_weights(weights, directory, safetensors)

    def load(self, directory: str, *, model: nn.Module, module: nn.Module, optimizer: Optional[torch.optim.Optimizer],
             load_optimizer: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        load_plain_weights(directory, module)
        if load_optimizer and optimizer is not None:
            path = os.path.join(directory, OPTIMIZER)
            if not os.path.exists(path):
                raise CheckpointError(f"{path} is missing: this checkpoint cannot be resumed (saved with save_only_model?).")
            saved = _regrouped(safe_torch_load(path), optimizer.param_groups, path)
            set_optimizer_state_dict(module, optimizer, saved, options=_options(full_state_dict=True))


def consolidate(directory: str, subdir: str = DCP_DIR) -> dict[str, torch.Tensor]:
    """The full model weights of a sharded checkpoint (the DCP folder `subdir` in it), read in this
    process without a process group (any number of processes may have saved it)."""
    from torch.distributed.checkpoint import CheckpointException, FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = os.path.join(directory, subdir)
    if not os.path.isdir(path):
        raise CheckpointError(f"{directory} has no {subdir}/ folder, so it is not a sharded checkpoint of that kind.")
    vet_dcp_folder(path)  # DCP unpickles .metadata and non-tensor entries unchecked: vet them first
    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as err:  # DCP's own type is a BaseException
        if weights_only_refusal(err):
            raise dcp_load_error(path, err, False) from None
        raise CheckpointError(f"{path} cannot be read ({(str(err) or type(err).__name__).splitlines()[0][:300]}).") from None
    model = state.get("model")
    if not isinstance(model, dict):
        raise CheckpointError(f"{path} holds no model weights.")
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}
