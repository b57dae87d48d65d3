"""`strategy: ddp`: every process holds the whole model; torch's `DistributedDataParallel`
averages gradients during backward. One process per device, started by a launcher (torchrun,
`kiln fit --nproc N`, `accelerate launch`, SLURM's srun); see `environment.py` for how the
topology is read.

Options (HF names in brackets): `strategy.backend` [ddp_backend] (default nccl on CUDA, gloo on
CPU), `strategy.timeout` [ddp_timeout] seconds before a collective gives up,
`strategy.find_unused_parameters` and `strategy.broadcast_buffers` [ddp_find_unused_parameters,
ddp_broadcast_buffers] (unset: find_unused_parameters is chosen on the first step, see ddp_unused.py
(HF: True); False with activation checkpointing; the name `ddp_find_unused_parameters_true` forces True), `strategy.bucket_cap_mb` [ddp_bucket_cap_mb],
`strategy.static_graph`.

Why the loop's loss weights look the way they do: DDP *averages* gradients over ranks, so the
loop scales each micro-batch's mean loss by n_i * world / N (N summed over ranks, with
`average_tokens_across_devices`, the default), which makes the averaged gradient that of the mean
over every item of the global window (see kiln/engine/loop/loss_weights.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from kiln.strategies import STRATEGIES
from kiln.strategies.base import Strategy
from kiln.strategies.capabilities import Capabilities
from kiln.strategies.collectives import ProcessGroupCollectives
from kiln.strategies.interfaces import BackwardSyncControl
from kiln.strategies.process_group import register_group_user


def _buffers_keyword() -> str:
    """torch 2.13 renamed DDP's `broadcast_buffers` to `forward_sync_buffers` (same meaning, except
    that buffers are always synced once at construction, which kiln wants anyway)."""
    import inspect

    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"


def _release_ddp(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Drop a DDP wrapper's hold on the process group: the same attributes DDP's own __getstate__
    leaves out (the reducer keeps a C++ reference to the group)."""
    for name in ("reducer", "logger", "process_group"):
        ddp.__dict__.pop(name, None)


def _tracked(ddp: nn.parallel.DistributedDataParallel) -> nn.parallel.DistributedDataParallel:
    register_group_user(ddp, _release_ddp)
    return ddp


def _ddp(module: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The DDP wrapper inside `module` (which may be torch.compile's wrapper around it)."""
    module = getattr(module, "_orig_mod", module)
    return module if isinstance(module, nn.parallel.DistributedDataParallel) else None


@STRATEGIES.register("ddp", "ddp_find_unused_parameters_true")
class DDPStrategy(ProcessGroupCollectives, Strategy, BackwardSyncControl):
    name = "ddp"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        reasons={
            "mps": "DDP needs gloo or NCCL collectives, which Apple GPUs do not have (one MPS device: strategy mps)",
            "xla": "XLA devices synchronise through XLA's own collectives (use strategy xla or xla_fsdp)",
        },
    )

    # -- set-up -----------------------------------------------------------------------------
    def ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for DistributedDataParallel, with Hugging Face's defaults."""
        s = self.config.strategy
        checkpointing = self._checkpointing()
        find = s.find_unused_parameters
        if find is None:
            # unset: False, then chosen on the first step (choose_unused_on_first_step); HF's default is True
            find = s.name == "ddp_find_unused_parameters_true"
        broadcast = s.broadcast_buffers if s.broadcast_buffers is not None else not checkpointing
        kwargs: dict[str, Any] = {
            "find_unused_parameters": find,
            _buffers_keyword(): broadcast,
            "static_graph": s.static_graph,
        }
        if s.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = s.bucket_cap_mb
        return kwargs

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = module.to(self.root_device)
        device_ids = [self._device.index] if self._device.type == "cuda" else None  # CPU: no device_ids
        self._choose_unused = self.choose_unused_on_first_step()
        return _tracked(nn.parallel.DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs()))

    # -- find_unused_parameters left unset: decided on the first step (see ddp_unused.py) ----------
    def choose_unused_on_first_step(self) -> bool:
        """Whether find_unused_parameters is left for the first step to decide (unset, and neither
        gradient checkpointing nor a static graph, which settle it already)."""
        s = self.config.strategy
        return (
            s.find_unused_parameters is None
            and s.name != "ddp_find_unused_parameters_true"
            and not self._checkpointing()
            and not s.static_graph
        )

    def _checkpointing(self) -> bool:
        from kiln.strategies.activation_checkpointing import policy

        return policy(self.config) is not None

    def _first_step_chooser(self, ddp: nn.parallel.DistributedDataParallel) -> contextlib.AbstractContextManager[Any]:
        from kiln.strategies.ddp.unused_parameters import first_boundary

        self._choose_unused = False  # once
        device_ids = [self._device.index] if self._device.type == "cuda" else None
        kwargs = {**self.ddp_kwargs(), "find_unused_parameters": True}

        def say(line: str) -> None:
            if self.is_global_zero and self.config.log.level not in ("error", "critical"):
                print(f"kiln: {line}", flush=True)

        return first_boundary(
            ddp,
            self.world_size,
            lambda m: _tracked(nn.parallel.DistributedDataParallel(m, device_ids=device_ids, **kwargs)),
            say,
        )

    def unwrap(self, model: nn.Module) -> nn.Module:
        ddp = _ddp(model)
        return ddp.module if ddp is not None else getattr(model, "_orig_mod", model)

    # -- step -------------------------------------------------------------------------------
    def micro_batch_context(self, model: nn.Module, *, boundary: bool) -> contextlib.AbstractContextManager[Any]:
        """No gradient all-reduce except on the window's last micro-batch (DDP decides at forward
        time, so this wraps forward and backward)."""
        ddp = _ddp(model)
        if not boundary and ddp is not None:
            return ddp.no_sync()
        if ddp is not None and getattr(self, "_choose_unused", False):
            return self._first_step_chooser(ddp)
        return contextlib.nullcontext()
