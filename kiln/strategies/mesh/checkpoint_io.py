"""The mesh strategy's checkpoints (`fsdp` and `model_parallel` alike), in kiln's `checkpoint-<step>/`.

- `state_dict_type: sharded` (default, format "fsdp-sharded"): one `torch.distributed.checkpoint`
  folder `fsdp_dcp/` holding the model and the optimizer, each rank writing its own shards (FSDP's dp
  shards and TP's splits are both DTensor shards, which DCP records with their global offsets). DCP
  reshards on load, so a checkpoint saved on one mesh resumes on another (N processes -> M, tp 2 ->
  dp_shard 2, and from one preset to the other: the mesh is not part of the format), and `kiln
  convert` reads the full weights in one process without a process group.
- `state_dict_type: full` (format "fsdp-full"): the weights gathered to rank 0 and written as
  model.safetensors, the optimizer state gathered into optimizer.pt (keyed by parameter name).

Before the two presets were one strategy, `model_parallel` wrote the same DCP folder under another
name ("model-parallel-dcp", folder `model_parallel_dcp/`); such checkpoints still convert, load and
resume (`ModelParallelDCPFormat`, and `also_resumes` on the sharded IO). Every loader also reads a
plain exported model folder (model.safetensors / pytorch_model.bin) for `load_weights_only`."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
from torch import nn

from kiln.strategies.checkpoint_io import CheckpointIO, StagedWrite, register_format
from kiln.strategies.dcp_files import consolidate, model_tensors, read_folder, regrouped, saved_group_count
from kiln.strategies.full_checkpoint_io import OPTIMIZER, read_full_files
from kiln.strategies.mesh.async_dcp import finished
from kiln.strategies.model_weights import apply_weights, load_weights, save_weights
from kiln.strategies.portable_state import PortableState, keyed_by_name, optimizer_names
from kiln.strategies.weights_files import share_tied, tie_groups
from kiln.utils.errors import CheckpointError
from kiln.utils.host_copy import HostStaging
from kiln.utils.safe_pickle import dcp_load_error, vet_dcp_folder
from kiln.utils.tensors import plain_tensor

DCP_DIR = "fsdp_dcp"
#: the folder model_parallel's checkpoints used before it became a preset of the mesh strategy
LEGACY_MODEL_PARALLEL_DIR = "model_parallel_dcp"


def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def full_model_state(module: nn.Module, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """The gathered weights on CPU: on rank 0 only (the others get {}), or on every rank. Tied
    weights stay one tensor (the gather makes a copy per name), so that a file stores them once, as
    the plain module's `state_dict()` would (`save_weights`, HF's `save_pretrained`)."""
    if every_rank:
        state = {k: v.detach().cpu() for k, v in _model_state(module, full_state_dict=True).items()}
    else:
        state = _model_state(module, full_state_dict=True, cpu_offload=True)
    state = {k: plain_tensor(v) for k, v in state.items()}  # float8 all-gather's weight wrappers
    return share_tied(state, tie_groups(module))


def _model_state(module: nn.Module, **options: bool) -> dict[str, Any]:
    """`get_model_state_dict`: its values are typed as DCP's union of state types; a model's are tensors."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_options(**options))


def set_full_model_state(module: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load full (unsharded) weights into the sharded module; each rank keeps its shard."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    _check_keys(module, state, source)
    loadable: dict[str, Any] = state  # DCP's value type is a union wider than Tensor
    set_model_state_dict(module, loadable, options=_options(full_state_dict=True))


def _check_keys(module: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """The names and shapes must fit; reuse the plain loader's one-sentence message on a mismatch."""
    own = module.state_dict()
    shapes_ok = all(tuple(state[k].shape) == tuple(_full_shape(v)) for k, v in own.items() if k in state)
    if set(own) != set(state) or not shapes_ok:
        shell = {k: torch.empty(_full_shape(v), device="meta") for k, v in own.items()}
        probe = _Probe(shell)
        apply_weights(probe, state, source)  # raises CheckpointError naming the keys


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


class _MeshCheckpointIO(CheckpointIO):
    translatable = True

    def __init__(self, strategy: Any = None) -> None:
        self.strategy = strategy

    def load_weights_only(self, directory: str, *, model: nn.Module, module: nn.Module) -> None:
        self.load(directory, model=model, module=module, optimizer=None, load_optimizer=False)

    def load_portable(
        self, state: PortableState, *, module: nn.Module, optimizer: torch.optim.Optimizer | None, source: str
    ) -> None:
        """Full weights and optimizer state, read whole on every rank; each rank keeps its shards."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_full_model_state(module, state.weights, source)
        if optimizer is not None:
            saved = keyed_by_name(state.optimizer, optimizer_names(module, optimizer), source)
            saved = regrouped(saved, optimizer.param_groups, source)
            set_optimizer_state_dict(module, optimizer, saved, options=_options(full_state_dict=True))


@register_format
class ShardedCheckpointIO(_MeshCheckpointIO):
    """One DCP folder per checkpoint; see the module docstring."""

    format = "fsdp-sharded"
    reshardable = True
    sharded = True
    also_resumes: ClassVar[tuple[str, ...]] = ("model-parallel-dcp",)
    #: the folder this format writes first, then older names of the same folder it also reads
    folders: ClassVar[tuple[str, ...]] = (DCP_DIR, LEGACY_MODEL_PARALLEL_DIR)

    @classmethod
    def folder_in(cls, directory: str) -> str:
        """The DCP folder of checkpoint `directory`: the first of `folders` it holds (the first if none)."""
        return next((f for f in cls.folders if os.path.isdir(os.path.join(directory, f))), cls.folders[0])

    @classmethod
    def consolidate(cls, directory: str) -> dict[str, torch.Tensor]:
        return consolidate(directory, cls.folder_in(directory))  # vets the DCP folder's pickles first

    @classmethod
    def portable(cls, directory: str) -> PortableState:
        """The DCP folder's model and optimizer read whole in this process (any mesh may have saved it)."""
        state = read_folder(directory, cls.folder_in(directory))
        if "optim" not in state:
            raise CheckpointError(
                f"{directory} holds no optimizer state: this checkpoint cannot be resumed (saved with save_only_model?)."
            )
        return PortableState(model_tensors(state, directory), state["optim"])

    def save(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        save_optimizer: bool,
        safetensors: bool,
        writer: bool,
    ) -> None:
        import torch.distributed.checkpoint as dcp

        state = self._state(module, optimizer, save_optimizer)
        dcp.save(state, checkpoint_id=os.path.join(directory, self.folders[0]))  # collective: every rank writes

    def stage(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        save_optimizer: bool,
        safetensors: bool,
        writer: bool,
        staging: HostStaging,
    ) -> StagedWrite | None:
        """DCP's `async_save` of the same state dict `save` writes (kiln.strategies.mesh.async_dcp): the
        shards are copied to host memory here, on every rank, and written by DCP's thread; the returned
        write waits for it, and on the writer that means every rank's shards are written."""
        state = self._state(module, optimizer, save_optimizer)
        future = self.strategy.async_checkpoints().save(state, os.path.join(directory, self.folders[0]))
        return lambda _: finished(future)

    def _state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer | None, save_optimizer: bool
    ) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {"model": get_model_state_dict(module)}
        if save_optimizer and optimizer is not None:
            state["optim"] = self.optimizer_state(get_optimizer_state_dict(module, optimizer))
        return state

    def load(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        load_optimizer: bool = True,
    ) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = os.path.join(directory, self.folder_in(directory))
        optim = optimizer if load_optimizer else None
        with_optim = optim is not None
        if not os.path.isdir(path):
            if with_optim:
                raise CheckpointError(
                    f"{path} is missing: {directory} is not a sharded checkpoint of strategy fsdp or "
                    "model_parallel; resume with the strategy and state_dict_type that saved it."
                )
            return load_plain_weights(directory, module)  # an exported model folder
        metadata = vet_dcp_folder(path)  # DCP unpickles .metadata and non-tensor entries unchecked: vet them first
        state: dict[str, Any] = {"model": get_model_state_dict(module)}
        if optim is not None:
            state["optim"] = get_optimizer_state_dict(module, optim)
            groups = state["optim"]["param_groups"]
            saved_groups = saved_group_count(metadata)
            if saved_groups and saved_groups != len(groups):  # the other param-group layout: load its groups whole
                state["optim"]["param_groups"] = [dict(groups[0]) for _ in range(saved_groups)]
        try:
            dcp.load(state, checkpoint_id=path)  # into this mesh's shards, whatever mesh saved them
        except (Exception, dcp.CheckpointException) as err:  # the latter is a BaseException
            raise dcp_load_error(path, err, with_optim) from None
        set_model_state_dict(module, state["model"])
        if optim is not None:
            saved = self.loaded_optimizer_state(state["optim"], groups)
            set_optimizer_state_dict(module, optim, regrouped(saved, groups, path))

    def optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The optimizer state as this rank writes it (a pipeline stage adds the others' parameter names
        to its param groups: pipeline_checkpoint.py)."""
        return state

    def loaded_optimizer_state(self, saved: dict[str, Any], groups: list[dict[str, Any]]) -> dict[str, Any]:
        """The optimizer state as read, before it is set into this rank's optimizer (`groups`: its
        param groups, by parameter name)."""
        return saved


@register_format
class ModelParallelDCPFormat(ShardedCheckpointIO):
    """model_parallel's checkpoints from before it became a preset of the mesh strategy: the same DCP
    folder under another format name and folder. Registered so that `kiln convert` reads them; the
    strategy resumes them through `ShardedCheckpointIO` (its `also_resumes`)."""

    format = "model-parallel-dcp"
    also_resumes = ()
    folders = (LEGACY_MODEL_PARALLEL_DIR,)


@register_format
class FullCheckpointIO(_MeshCheckpointIO):
    format = "fsdp-full"
    reshardable = True
    sharded = False

    @classmethod
    def consolidate(cls, directory: str) -> dict[str, torch.Tensor]:
        return load_weights(directory)

    @classmethod
    def portable(cls, directory: str) -> PortableState:
        return read_full_files(directory)

    def save(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        save_optimizer: bool,
        safetensors: bool,
        writer: bool,
    ) -> None:
        weights, optim = self._gather(module, optimizer, save_optimizer, writer)
        if writer:
            _write_gathered(directory, weights, optim, safetensors)

    def stage(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        save_optimizer: bool,
        safetensors: bool,
        writer: bool,
        staging: HostStaging,
    ) -> StagedWrite | None:
        """The gathers are collectives on the training process group, so they run here, at the step
        boundary, on every rank, as `save`'s do; the gathered state is then copied into host buffers of
        its own (a gather may hand back the live tensors: one process, or a replicated parameter), and the
        files are written on the background thread, so the disk write leaves the step loop."""
        weights, optim = self._gather(module, optimizer, save_optimizer, writer)
        if not writer:
            return lambda directory: None
        weights, optim = staging.copy((weights, optim))

        def write(directory: str) -> None:
            _write_gathered(directory, weights, optim, safetensors, in_background=True)

        return write

    def _gather(
        self, module: nn.Module, optimizer: torch.optim.Optimizer | None, save_optimizer: bool, writer: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """The full weights (on rank 0, and on another node's writer with save.on_each_node) and the full
        optimizer state (kept on rank 0 only): collectives, every rank takes part."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        weights = full_model_state(module, every_rank=writer and not self.strategy.is_global_zero)
        optim = None
        if save_optimizer and optimizer is not None:  # collective: every rank takes part
            optim = get_optimizer_state_dict(
                module, optimizer, options=_options(full_state_dict=True, cpu_offload=True)
            )
        # another node's local rank 0 (save.on_each_node) writes the weights it gathered, without optimizer.pt
        return weights, optim if self.strategy.is_global_zero else None

    def load(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        load_optimizer: bool = True,
    ) -> None:
        if not load_optimizer or optimizer is None:
            return load_plain_weights(directory, module)
        self.load_portable(read_full_files(directory), module=module, optimizer=optimizer, source=directory)


def _write_gathered(
    directory: str,
    weights: dict[str, torch.Tensor],
    optim: dict[str, Any] | None,
    safetensors: bool,
    in_background: bool = False,
) -> None:
    """An `fsdp-full` checkpoint's weights and `optimizer.pt` (None: not on this writer)."""
    save_weights(weights, directory, safetensors, in_background=in_background)
    if optim is not None:
        torch.save(optim, os.path.join(directory, OPTIMIZER))
