"""Every rank starting from rank 0's weights. `sync_module_states` broadcasts them before sharding;
`cpu_ram_efficient_loading` (HF/accelerate's name): rank 0 builds the real model, every other rank
builds it on the meta device (`MeshStrategy.module_init_context`), and after sharding rank 0 sends
each rank only its own slice of every parameter. No rank but 0 ever holds a full copy, nor even one
full parameter: the slices go point to point, straight into the shard's storage. Buffers are not
sharded by FSDP, so they are broadcast whole."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kiln.utils.errors import ConfigError


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type != "cpu":
        states.append(torch.get_device_module(device.type).get_rng_state())
    return states


def _set_rng_states(device: torch.device, states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if device.type != "cpu":
        torch.get_device_module(device.type).set_rng_state(states[1])


@contextlib.contextmanager
def built_on_rank0(rank: int, device: torch.device) -> Iterator[None]:
    """Ranks > 0 build on the meta device, which draws no random numbers. Afterwards a rank whose
    generators started where rank 0's did (kiln seeds every rank alike) is moved to where rank 0's
    ended, so dropout and the data order afterwards are what a normal run draws. Every rank must
    enter it (a broadcast on exit)."""
    import torch.distributed as dist

    before = _rng_states(device)
    with torch.device("meta") if rank else contextlib.nullcontext():
        yield
    box = [(before, _rng_states(device))]
    dist.broadcast_object_list(box, src=0)
    theirs_before, theirs_after = box[0]
    if rank and all(torch.equal(a, b) for a, b in zip(before, theirs_before)):
        _set_rng_states(device, theirs_after)


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _local_slices(module: nn.Module) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(name, global offset, local shape) of this rank's shard of every parameter."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = []
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        else:  # not sharded (a module FSDP did not reach): the whole tensor
            shape, offset = tuple(p.shape), (0,) * p.dim()
        out.append((name, tuple(offset), tuple(shape)))
    return out


def _slice(full: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def scatter_from_rank0(module: nn.Module, full: dict[str, torch.Tensor], device: torch.device) -> None:
    """Fill every rank's shards (materialised but uninitialised on ranks > 0) with rank 0's values:
    `full` is rank 0's parameters (name -> full tensor) before sharding, {} elsewhere. `device` is
    where the process group's collectives run (cpu for gloo, the GPU for NCCL)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = _local_slices(module)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    names = [name for name, _, _ in mine]
    if any([n for n, _, _ in other] != names for other in every):
        raise ConfigError(
            "cpu_ram_efficient_loading: the ranks built models with different parameters; "
            "model_init must build the same model on every rank."
        )
    params = dict(module.named_parameters())
    with torch.no_grad():
        for i, name in enumerate(names):
            if rank == 0:
                for dst in range(1, world):
                    _, offset, shape = every[dst][i]
                    if all(shape):
                        dist.send(_slice(full[name], offset, shape).to(device).contiguous(), dst=dst)
                continue  # rank 0 sharded its own real values already
            p = params[name]
            local = p.to_local() if isinstance(p, DTensor) else p.data
            if local.numel() == 0:
                continue
            direct = local.device == device and local.is_contiguous()
            buf = local if direct else torch.empty(local.shape, dtype=local.dtype, device=device)
            dist.recv(buf, src=0)
            if not direct:
                local.copy_(buf)
        for buf in module.buffers():  # not sharded: every rank keeps the whole (small) buffer
            moved = buf.to(device)
            dist.broadcast(moved, src=0)
            if moved is not buf:
                buf.copy_(moved)


def rank0_parameters(module: nn.Module) -> dict[str, Any]:
    """Rank 0's full parameters by name, kept before sharding replaces them."""
    return {name: p.detach() for name, p in module.named_parameters()}


def sync_module_states(module: nn.Module) -> None:
    """Every rank starts from rank 0's parameters and buffers."""
    import torch.distributed as dist

    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)
