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


def sharded_stage_counts(params: list[torch.nn.Parameter], device: torch.device) -> list[int] | None:
    """Each rank's parameter count, in rank order, where on every rank each of `params` (an optimizer's,
    under pp x dp_shard) is a float32 FSDP2 shard (a DTensor), which `clip_over_sharded_stages` needs;
    None where on any rank one is not. One all-gather, which every rank makes once per optimizer."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    fits = all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in params)
    mine = torch.tensor([len(params) if fits else -1], device=device)
    every = mine.new_empty(dist.get_world_size())
    _all_gather(every, mine)
    counts = [int(c) for c in every.tolist()]
    return None if min(counts) < 0 else counts


def clip_over_sharded_stages(
    params: list[torch.nn.Parameter],
    max_norm: float,
    counts: list[int],
    stage_ranks: int,
    rank: int,
    device: torch.device,
    riders: torch.Tensor | None = None,
) -> torch.Tensor:
    """`clip_over_stages` under pp x dp_shard, where each of `params` (this rank's optimizer's, in its
    order) is a float32 FSDP2 shard over its stage's dp_shard ranks (ranks s * stage_ranks .. (s + 1)
    * stage_ranks - 1 hold stage s; `counts`: each rank's parameter count, `sharded_stage_counts`):
    one all-gather over every rank in place of DTensor's all-reduce over the stage's ranks and then
    pp's, and the norms taken on the local shards without DTensor's dispatch (some 550 Python calls a
    step). Each rank sends its shards' norms squared (0 for a parameter without a gradient) and every
    rank then computes what the two all-reduces did: each gradient's squares summed over its stage's
    ranks and rooted (DTensor's reduction of the per-gradient norms), the stage's norm over them,
    squared, summed over the stages, rooted. Bitwise the two all-reduces' result where each of their
    sums adds two values (pp 2 x dp_shard 2) and every parameter has a gradient; with more ranks, the
    sums run in rank order. `riders` are summed over this rank's pipeline as `clip_over_stages` sums
    them. Returns the norm."""
    import torch.distributed as dist

    width = max(counts)
    grads = [p.grad for p in params]
    held = [g._local_tensor for g in grads if g is not None]  # type: ignore[attr-defined]
    extra = riders.numel() if riders is not None else 0
    row = torch.zeros(width + extra, dtype=torch.float32, device=device)
    if held:
        # each shard's norm (get_total_norm's per-tensor path: DTensor has no foreach support), then the
        # first step of _NormPartial's reduction, x ** 2, before the sum over the stage's ranks
        squares = torch.stack([torch.linalg.vector_norm(t, 2.0) for t in held]) ** 2.0
        if len(held) == len(grads):
            row[: len(held)] = squares
        else:
            row[[i for i, g in enumerate(grads) if g is not None]] = squares
    if riders is not None:
        row[width:] = riders
    every = row.new_empty(dist.get_world_size() * row.numel())
    _all_gather(every, row)
    blocks = every.view(-1, stage_ranks, row.numel())  # (stage, rank in the stage, values)
    stages = [
        torch.linalg.vector_norm(block[:, : counts[s * stage_ranks]].sum(0) ** 0.5, 2.0).pow(2)  # squared as
        for s, block in enumerate(blocks)  # clip_over_stages squares each stage's norm
    ]
    norm = torch.stack(stages).sum().sqrt()
    if riders is not None:
        riders.copy_(blocks[:, rank % stage_ranks, width:].sum(0))
    clip_coef = max_norm / (norm + 1e-6)  # clip_grads_with_norm_'s own expressions, on the shards
    if held:
        torch._foreach_mul_(held, torch.clamp(clip_coef, max=1.0))
    return norm


def _all_gather(out: torch.Tensor, mine: torch.Tensor) -> None:
    """Every rank's `mine`, in rank order, into `out` (torch 2.6's all_gather_into_tensor, which later
    versions name all_gather_single)."""
    import torch.distributed as dist

    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, mine)


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
