"""A strategy plug-in written outside kiln/ (the proof that a new strategy needs no kiln edit): FSDP2 over
a 2-D DeviceMesh `("replicate", "shard")` of shape (1, world) -- HSDP whose replicate axis has one group --
with a checkpoint format of its own, "two-d-shards", that `kiln convert` consolidates.

Its checkpoint folder holds `two_d/rank<r>-of-<w>.safetensors` (each rank's local parameter shards, the
layout in the file's metadata) and, for resuming, `two_d/optim/` (the optimizer's sharded state in DCP,
vetted before it is read). `consolidate` concatenates the ranks' shards along the first dimension
(how FSDP2 shards) without torch.distributed.

Registered by one line where the tests need it (tests/strategies/contract/scenarios.py):
`STRATEGIES.add_lazy("two_d", "tests.strategies.plugins.two_d")`; importing this file registers the
format, so a process that imported it converts such checkpoints.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
from typing import Any

import torch
from torch import nn

from kiln.strategies import STRATEGIES
from kiln.strategies.base import Strategy
from kiln.strategies.capabilities import Capabilities
from kiln.strategies.checkpoint_io import CheckpointIO, register_format
from kiln.strategies.collectives import ProcessGroupCollectives
from kiln.strategies.interfaces import BackwardSyncControl
from kiln.strategies.mesh.checkpoint_io import full_model_state, set_full_model_state
from kiln.strategies.mesh.dims import release_mesh_groups
from kiln.strategies.mesh.fsdp import release_fsdp_groups
from kiln.strategies.model_weights import load_weights
from kiln.strategies.process_group import register_group_user
from kiln.utils.errors import CheckpointError
from kiln.utils.safe_pickle import dcp_load_error, vet_dcp_folder

FOLDER = "two_d"
_FILE = re.compile(r"^rank(\d+)-of-(\d+)\.safetensors$")


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach()


@register_format
class TwoDShardsCheckpointIO(CheckpointIO):
    format = "two-d-shards"
    reshardable = False  # each file is one rank's shard of this world size
    sharded = True

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def _file(self, directory: str) -> str:
        s = self.strategy
        return os.path.join(directory, FOLDER, f"rank{s.global_rank}-of-{s.world_size}.safetensors")

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
        from safetensors.torch import save_file
        from torch.distributed.tensor import DTensor

        state = module.state_dict()
        layout = {k: {"shape": list(v.shape), "sharded": isinstance(v, DTensor)} for k, v in state.items()}
        os.makedirs(os.path.join(directory, FOLDER), exist_ok=True)
        save_file(
            {k: _local(v).cpu().clone().contiguous() for k, v in state.items()},
            self._file(directory),
            metadata={"layout": json.dumps(layout)},
        )
        if save_optimizer and optimizer is not None:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            dcp.save(
                {"optim": get_optimizer_state_dict(module, optimizer)},
                checkpoint_id=os.path.join(directory, FOLDER, "optim"),
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
        from safetensors.torch import load_file

        with_optim = load_optimizer and optimizer is not None
        path = self._file(directory)
        if not os.path.exists(path):
            if with_optim:
                raise CheckpointError(
                    f"{path} is missing: resume a two_d checkpoint with the world size that saved it."
                )
            return set_full_model_state(module, load_weights(directory), directory)  # an exported model folder
        saved = load_file(path)
        with torch.no_grad():
            for name, value in module.state_dict().items():
                _local(value).copy_(saved[name])
        if with_optim:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

            folder = os.path.join(directory, FOLDER, "optim")
            vet_dcp_folder(folder)  # DCP unpickles its metadata unchecked
            state = {"optim": get_optimizer_state_dict(module, optimizer)}
            try:
                dcp.load(state, checkpoint_id=folder)
            except (Exception, dcp.CheckpointException) as err:
                raise dcp_load_error(folder, err, True) from None
            set_optimizer_state_dict(module, optimizer, state["optim"])

    @classmethod
    def consolidate(cls, directory: str) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        found = {}
        for path in glob.glob(os.path.join(directory, FOLDER, "rank*-of-*.safetensors")):
            match = _FILE.match(os.path.basename(path))
            if match:
                found[int(match.group(1))] = (int(match.group(2)), path)
        worlds = {world for world, _ in found.values()}
        if len(worlds) != 1 or sorted(found) != list(range(next(iter(worlds)))):
            raise CheckpointError(f"{directory}/{FOLDER} does not hold one shard file per rank of one world size.")
        shards, layout = [], {}
        for rank in sorted(found):
            with safe_open(found[rank][1], framework="pt") as fh:
                layout = json.loads((fh.metadata() or {})["layout"])
                shards.append({k: fh.get_tensor(k) for k in fh.keys()})  # noqa: SIM118 - safe_open is no dict
        full = {}
        for name, info in layout.items():
            value = torch.cat([s[name] for s in shards]) if info["sharded"] else shards[0][name]
            if list(value.shape) != info["shape"]:
                raise CheckpointError(
                    f"{directory}/{FOLDER}: the shards of {name} do not make its shape {info['shape']}."
                )
            full[name] = value
        return full


@STRATEGIES.register("two_d")
class TwoDStrategy(ProcessGroupCollectives, Strategy, BackwardSyncControl):
    """kiln's process group and collectives (the mixin); FSDP2 over a (replicate=1, shard=world) mesh."""

    name = "two_d"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        precisions=frozenset({"fp32"}),
        auto_batch_size=False,
        full_eval_cast=False,
        user_optimizer=False,
        reasons={"bf16": "two_d has no mixed-precision policy; use precision: fp32"},
    )
    checkpoint_formats = (TwoDShardsCheckpointIO.format,)

    def setup_module(self, module: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.root_device.type, (1, self.world_size), mesh_dim_names=("replicate", "shard"))
        register_group_user(mesh, release_mesh_groups)
        # reshard_after_forward explicitly: FSDP2 otherwise keeps the root unsharded after a forward, and a
        # no-grad forward (evaluation before training) would leave unsharded views that later evaluations
        # read without re-gathering the trained shards
        module = fully_shard(module.to(self.root_device), mesh=mesh, reshard_after_forward=True)
        register_group_user(module, release_fsdp_groups)
        return module

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "_orig_mod", model)

    def micro_batch_context(self, model: nn.Module, *, boundary: bool) -> contextlib.AbstractContextManager[Any]:
        self.unwrap(model).set_requires_gradient_sync(boundary)  # reduce once per accumulation window
        return contextlib.nullcontext()

    def clip_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, False, None)
        total = total.full_tensor() if isinstance(total, DTensor) else total
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, None)
        return total

    def probe_module(self, model: nn.Module) -> nn.Module:  # never called: capabilities.auto_batch_size is False
        raise NotImplementedError("auto_find_batch_size is not supported with strategy 'two_d'.")

    def checkpoint_io(self) -> CheckpointIO:
        return TwoDShardsCheckpointIO(self)

    def model_state_for_export(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return full_model_state(self.unwrap(module), every_rank=True)
