"""Checkpoints of `strategy: xla_fsdp`, in kiln's `checkpoint-<step>/` folder.

- SPMD (format "xla-spmd-sharded"): a `torch.distributed.checkpoint` folder `xla_dcp/` with the model
  and the optimizer, each device's shard written by torch_xla's SPMD planners (SPMDSavePlanner /
  SPMDLoadPlanner). The files are plain DCP, so `kiln convert` merges them without torch_xla.
  An optimizer has no state before its first step, and DCP loads in place, so resuming first
  creates the state with torch_xla's `prime_optimizer` (one zero-gradient step that the load then
  overwrites, parameters included). It leaves zero gradients on the parameters, as a run keeps them
  (xla_gradients.py), so the steps after the load replay the uninterrupted run's graphs: bit for bit.
- classic wrapper (format "xla-fsdp-classic"): `xla_fsdp_classic/rank<r>-of-<w>.pt` per process
  (the wrapper's flat shards and the optimizer state, on the CPU) with `rank<r>-of-<w>.json` beside
  it (`get_shard_metadata()`: how shards unflatten into the user's parameters). Resuming needs the
  same number of processes; `kiln convert` and `save_model()` unflatten the shards into full weights.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from torch import nn

from kiln.strategies.checkpoint_io import CheckpointIO, register_format
from kiln.strategies.model_weights import apply_weights, load_weights
from kiln.strategies.xla.checkpoint_io import to_cpu
from kiln.utils.errors import CheckpointError, safe_torch_load
from kiln.utils.param_groups import regroup_optimizer_state
from kiln.utils.safe_pickle import dcp_load_error, vet_dcp_folder

SPMD_DIR = "xla_dcp"
CLASSIC_DIR = "xla_fsdp_classic"


@register_format
class SPMDCheckpointIO(CheckpointIO):
    format = "xla-spmd-sharded"
    reshardable = True  # one process in every SPMD run; DCP places the shards on whatever mesh loads them
    sharded = True

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    @classmethod
    def consolidate(cls, directory: str) -> dict[str, torch.Tensor]:
        return consolidate_spmd(directory)

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
        from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

        state: dict[str, Any] = {"model": module.state_dict()}
        if save_optimizer and optimizer is not None:
            state["optim"] = optimizer.state_dict()
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(os.path.join(directory, SPMD_DIR)),
            planner=SPMDSavePlanner(),
            no_dist=True,
        )

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
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, prime_optimizer

        path = os.path.join(directory, SPMD_DIR)
        optim = optimizer if load_optimizer else None
        with_optim = optim is not None
        if not os.path.isdir(path):
            if with_optim:
                raise CheckpointError(
                    f"{path} is missing: {directory} is not an SPMD XLA FSDP checkpoint; resume with "
                    "the strategy that saved it."
                )
            apply_weights(module, load_weights(directory), directory)  # an exported model folder
            return
        vet_dcp_folder(path)  # DCP unpickles .metadata and non-tensor entries unchecked: vet them first
        if optim is not None and not optim.state:
            prime_optimizer(optim)  # leaves zero gradients sharded like their parameters, as in-run
        state: dict[str, Any] = {"model": module.state_dict()}
        if optim is not None:
            state["optim"] = optim.state_dict()
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=SPMDLoadPlanner(), no_dist=True)
        except (Exception, dcp.CheckpointException) as err:  # DCP's own type is a BaseException
            raise dcp_load_error(path, err, with_optim) from None
        module.load_state_dict(state["model"])
        if optim is not None:
            optim.load_state_dict(regroup_optimizer_state(state["optim"], optim.param_groups))
        sync()  # the loaded values become device data, so the next step compiles the same graph as before the save


def sync() -> None:
    import torch_xla

    torch_xla.sync()


def consolidate_spmd(directory: str) -> dict[str, torch.Tensor]:
    """The full weights of an SPMD checkpoint, read without torch_xla (for `kiln convert`)."""
    from kiln.strategies.dcp_files import consolidate

    return consolidate(directory, SPMD_DIR)  # vets the DCP folder's pickles first


# -- the classic wrapper ------------------------------------------------------------------------
def _files(directory: str, rank: int, world: int) -> tuple[str, str]:
    stem = os.path.join(directory, CLASSIC_DIR, f"rank{rank}-of-{world}")
    return stem + ".pt", stem + ".json"


def unflatten_shards(states: list[dict[str, torch.Tensor]], meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Full parameters from every rank's flat shards (in rank order) and the wrapper's shard metadata:
    each `_fsdp_shard` tensor is the concatenation of the ranks' pieces cut to its unpadded size, and
    each `flat_param_<i>` splits into the original parameters listed in `flatten_info`."""
    full: dict[str, torch.Tensor] = {}
    for name, tensor in states[0].items():
        parts = name.split(".")
        at = next((i for i, part in enumerate(parts) if part.startswith("_fsdp_shard")), None)
        if at is None:  # a buffer: not sharded, rank 0's copy
            full[name] = tensor
            continue
        prefix, suffix = ".".join(parts[:at]), ".".join(parts[at:])
        info = meta["shard_info"][prefix][suffix]
        size = [int(d) for d in info["_orig_size"]]
        joined = torch.cat([s[name].reshape(-1) for s in states])[: math.prod(size)]
        full[f"{prefix}.{info['_orig_name']}" if prefix else info["_orig_name"]] = joined.view(size)
    for name in [k for k in full if "_fsdp_wrapped_module.flat_param_" in k]:
        names, shapes, numels = meta["flatten_info"][name]
        prefix = name.rsplit(".", 1)[0]
        for piece, sub, shape in zip(full.pop(name).split([int(n) for n in numels]), names, shapes):
            full[f"{prefix}.{sub}"] = piece.view([int(d) for d in shape])
    return {k.replace("_fsdp_wrapped_module.", "").replace("_fpw_module.", ""): v for k, v in full.items()}


def _strip(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Names relative to the user's module (the wrapped root may be kiln's step dispatcher around it)."""
    if not prefix:
        return state
    return {k[len(prefix) + 1 :]: v for k, v in state.items() if k.startswith(prefix + ".")}


def classic_full_state(strategy: Any, wrapped: Any, module: nn.Module) -> dict[str, torch.Tensor]:
    """Full weights of the user's module from the classic wrapper's shards, on every rank (`wrapped`: torch_xla's
    XlaFullyShardedDataParallel, which has no type information)."""
    mine = (to_cpu(wrapped.state_dict()), wrapped.get_shard_metadata())
    gathered = strategy.all_gather_object(mine)
    return _strip(unflatten_shards([s for s, _ in gathered], gathered[0][1]), strategy.prefix_of(module))


def consolidate_classic(directory: str) -> dict[str, torch.Tensor]:
    """The full weights of a classic-wrapper checkpoint, read without torch_xla (for `kiln convert`)."""
    folder = os.path.join(directory, CLASSIC_DIR)
    metas = sorted(f for f in os.listdir(folder) if f.endswith(".json")) if os.path.isdir(folder) else []
    if not metas:
        raise CheckpointError(
            f"{directory} has no {CLASSIC_DIR}/ shard files, so it is not a classic XLA FSDP checkpoint."
        )
    with open(os.path.join(folder, metas[0]), encoding="utf-8") as fh:
        first = json.load(fh)
    world = int(first["shard_metadata"]["world_size"])
    states = []
    for rank in range(world):
        weights, _ = _files(directory, rank, world)
        if not os.path.exists(weights):
            raise CheckpointError(f"{weights} is missing: the checkpoint needs the shards of all {world} processes.")
        states.append(safe_torch_load(weights)["model"])
    return _strip(unflatten_shards(states, first["shard_metadata"]), first["prefix"])


@register_format
class ClassicXLAFSDPCheckpointIO(CheckpointIO):
    format = "xla-fsdp-classic"
    reshardable = False  # the flat shards are cut for this number of processes
    sharded = True

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    @classmethod
    def consolidate(cls, directory: str) -> dict[str, torch.Tensor]:
        return consolidate_classic(directory)

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
        s = self.strategy
        weights, meta = _files(directory, s.global_rank, s.world_size)
        os.makedirs(os.path.dirname(weights), exist_ok=True)
        payload: dict[str, Any] = {"model": to_cpu(model.state_dict())}
        if save_optimizer and optimizer is not None:
            payload["optimizer"] = to_cpu(optimizer.state_dict())
        torch.save(payload, weights)
        with open(meta, "w", encoding="utf-8") as fh:
            wrapped: Any = model  # torch_xla's XlaFullyShardedDataParallel (no type information)
            json.dump({"shard_metadata": wrapped.get_shard_metadata(), "prefix": s.prefix_of(module)}, fh)

    def load(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        load_optimizer: bool = True,
    ) -> None:
        s = self.strategy
        weights, _ = _files(directory, s.global_rank, s.world_size)
        if not os.path.exists(weights):
            if os.path.isdir(os.path.join(directory, CLASSIC_DIR)):
                raise CheckpointError(
                    f"{weights} is missing: a classic XLA FSDP checkpoint resumes only on the number "
                    "of processes that saved it."
                )
            raise CheckpointError(f"{directory} is not a classic XLA FSDP checkpoint ({CLASSIC_DIR}/ is missing).")
        payload = safe_torch_load(weights)
        model.load_state_dict(payload["model"])
        if load_optimizer and optimizer is not None:
            if "optimizer" not in payload:
                raise CheckpointError(
                    f"{weights} has no optimizer state (saved with save_only_model?); it cannot be resumed."
                )
            optimizer.load_state_dict(regroup_optimizer_state(payload["optimizer"], optimizer.param_groups))
