"""Gradient clipping to the true global 2-norm under the mesh strategy: the norm of the whole model's
gradient, whichever ranks hold which shards of it, then every rank's shards scaled by the same factor."""

from __future__ import annotations

import torch


def clip_global_norm(
    params: list[torch.nn.Parameter], max_norm: float, *, tp: bool, world: int, device: torch.device
) -> torch.Tensor:
    """Clip the gradients of `params` (each with a gradient) to `max_norm`; returns the norm before.

    Without tp every gradient is an FSDP shard on the one dp mesh: each rank's norm over its shards is
    a partial result that DTensor reduces over the mesh (`full_tensor`), as FSDP2 is used. With tp,
    gradients live on different meshes (TP-split layers on (dp, tp), the rest on the dp mesh alone, or
    plain tensors without FSDP), which DTensor's own norm cannot mix: see `clip_across_meshes`."""
    from torch.distributed.tensor import DTensor

    if not tp:
        total = torch.nn.utils.get_total_norm(_grads(params), 2.0, False, None)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, None)
        return total
    return clip_across_meshes(_grads(params), max_norm, world, world, device)


def clip_over_stages(
    params: list[torch.nn.Parameter],
    max_norm: float,
    group: object,
    device: torch.device,
    riders: torch.Tensor | None = None,
) -> torch.Tensor:
    """A pipeline's clipping: each stage's norm (DTensor's over its dp_shard ranks), their squares summed
    over the pipeline `group`, then each stage's gradients scaled by the same factor; returns the norm.
    `riders` (a 1-d float tensor) are summed over `group` in the same all-reduce and written back in
    place: one collective instead of two, and the sum of the squares is the one a lone all-reduce gives
    (it is the same element, summed in the same order)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    local = torch.nn.utils.get_total_norm(_grads(params), 2.0)
    if isinstance(local, DTensor):
        local = local.full_tensor()
    squares = local.float().pow(2).to(device)
    if riders is not None:
        both = torch.cat([squares.reshape(1), riders])
        dist.all_reduce(both, group=group)
        squares = both[0]
        riders.copy_(both[1:])
    else:
        dist.all_reduce(squares, group=group)
    norm = squares.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def _grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]  # every one has a gradient (the caller's contract)


def clip_across_meshes(
    grads: list[torch.Tensor], max_norm: float, holders: int, world: int, device: torch.device
) -> torch.Tensor:
    """Each rank sums its local squares, each weighted by 1 / (the number of ranks holding that same
    shard: of the `holders` ranks that hold the parameter -- every rank, or under pp one stage's --
    those with the same piece), and one all-reduce over every rank of the `world` adds them up;
    returns the norm."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    local = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]  # the storage this rank holds
    total = torch.zeros((), dtype=torch.float32, device=device)
    with torch.no_grad():
        for g, mine in zip(grads, local):
            distinct = 1  # how many different pieces of this gradient the ranks hold
            if isinstance(g, DTensor):
                for dim, placement in enumerate(g.placements):
                    if not isinstance(placement, Replicate):  # Shard, or FSDP's _StridedShard over TP
                        distinct *= g.device_mesh.size(dim)
            square = (mine if mine.dtype == torch.float32 else mine.float()).pow(2).sum()
            weight = distinct / holders
            total += square if weight == 1 else square * weight  # x * 1.0 is x: the same bits, one op fewer
        if world > 1:
            dist.all_reduce(total)
        norm = total.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for mine in local:
            by_dtype.setdefault(mine.dtype, []).append(mine)
        for dtype, tensors in by_dtype.items():  # one call per dtype; each tensor's product as its own mul_
            torch._foreach_mul_(tensors, coef.to(dtype))
    return norm
