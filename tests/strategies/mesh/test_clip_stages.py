"""clip.py's pipeline clipping under pp x dp_shard in one all-gather (`clip_over_sharded_stages`) against
the two all-reduces it replaces (`clip_over_stages`: DTensor's over the stage's dp_shard ranks, then the
pipeline's), in a real world of 2 gloo processes: one stage over 2 dp_shard ranks, and 2 stages of one
rank each holding different parameter counts, the window's losses riding along. The norm, every shard
and the losses are bitwise those of the two all-reduces; a parameter without a gradient counts 0; a
rank whose parameters are not float32 shards makes every rank fall back.

Run by `run_world`, this file is the worker (`python THIS OUT`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if __name__ == "__main__":  # the world's worker: the repository root first, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.world import run_world  # noqa: E402


def _params(mesh: Any, shapes: list[tuple[int, ...]], seed: int, grads: bool = True) -> list[torch.nn.Parameter]:
    """Parameters sharded over `mesh` (dim 0, uneven where the rows do not divide), with sharded gradients
    of the same full values on every rank of the mesh."""
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        p = torch.nn.Parameter(distribute_tensor(torch.randn(shape, generator=g), mesh, [Shard(0)]))
        if grads:
            p.grad = distribute_tensor(torch.randn(shape, generator=g), mesh, [Shard(0)])
        out.append(p)
    return out


def _both(params: list[Any], max_norm: float, stage_ranks: int, group: Any, riders: torch.Tensor | None) -> dict:
    """The two all-reduces' clipping and the all-gather's, each on its own copy of the gradients."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from kiln.strategies.mesh.clip import clip_over_sharded_stages, clip_over_stages, sharded_stage_counts

    def copy() -> list[Any]:
        out = []
        for p in params:
            q = torch.nn.Parameter(p.detach().clone())
            q.grad = p.grad.detach().clone() if p.grad is not None else None
            out.append(q)
        return out

    cpu = torch.device("cpu")
    old, new = copy(), copy()
    old_riders = riders.clone() if riders is not None else None
    new_riders = riders.clone() if riders is not None else None
    want = clip_over_stages([p for p in old if p.grad is not None], max_norm, group, cpu, old_riders)
    counts = sharded_stage_counts(new, cpu)
    assert counts is not None
    rank = dist.get_rank()
    got = clip_over_sharded_stages(new, max_norm, counts, stage_ranks, rank, cpu, new_riders)
    local = lambda ps: [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for p in ps]  # noqa: E731
    return {
        "counts": counts,
        "norm": (want, got),
        "grads": (local(old), local(new)),
        "riders": (old_riders, new_riders),
    }


def worker(out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from kiln.strategies.mesh.clip import sharded_stage_counts

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    # one stage over 2 dp_shard ranks (the pipeline: each rank alone)
    alone = [dist.new_group([0]), dist.new_group([1])][rank]
    flat = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    params = _params(flat, [(5, 3), (4,), (7, 2)], seed=0)
    results["one stage"] = _both(params, 0.1, 2, alone, None)
    # pp 2 x dp_shard 1: each rank a stage of its own, with its own parameter count; the losses ride along
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp_shard"))
    shapes = [[(5, 3), (4,), (6,)], [(3, 3), (2, 5)]][rank]
    params = _params(mesh["dp_shard"], shapes, seed=1 + rank)
    losses = torch.tensor([2.5, 1.25, 3.0]) if rank == 1 else torch.full((3,), -0.0)
    results["two stages"] = _both(params, 0.5, 1, mesh["pp"].get_group(), losses)
    # a parameter without a gradient (rank 0's second) counts 0
    params[1 if rank == 0 else 0].grad = None if rank == 0 else params[0].grad
    results["no gradient"] = _both(params, 0.5, 1, mesh["pp"].get_group(), losses)
    # rank 1 holds a plain tensor: no rank takes the all-gather
    plain = _params(mesh["dp_shard"], [(3,)], seed=9) + ([torch.nn.Parameter(torch.ones(2))] if rank == 1 else [])
    results["fallback"] = sharded_stage_counts(plain, torch.device("cpu"))
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_one_all_gather_clips_bitwise_as_the_two_all_reduces(tmp_path):
    run_world(__file__, tmp_path, nproc=2, timeout=300)
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert res["one stage"]["counts"] == [3, 3] and res["two stages"]["counts"] == [3, 2]
        for case in ("one stage", "two stages"):
            want, got = res[case]["norm"]
            assert torch.equal(want, got), (r, case, want, got)
            assert want > (0.1 if case == "one stage" else 0.5)  # over max_norm: the gradients are scaled
            for a, b in zip(*res[case]["grads"]):
                assert torch.equal(a, b), (r, case)
        old, new = res["two stages"]["riders"]
        assert torch.equal(old, new) and new.tolist() == [2.5, 1.25, 3.0], (r, old, new)
        want, got = res["no gradient"]["norm"]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        assert res["fallback"] is None


def test_four_ranks_of_two_stages_are_summed_by_stage_then_over_the_stages(monkeypatch):
    """pp 2 x dp_shard 2 without a world: each rank's row recorded, then the four rows handed to every
    rank as the all-gather would. Stage 0 holds 3 parameters, stage 1 two (its rows padded to 3, the
    padding never read); each
    stage's squares summed over its 2 ranks, rooted, its norm squared, the stages summed; the losses
    (on stage 1's ranks) summed over each rank's pipeline; every shard scaled by the same factor."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from kiln.strategies.mesh import clip

    g = torch.Generator().manual_seed(0)
    shards = [[torch.randn(4, generator=g) for _ in range(3 if r < 2 else 2)] for r in range(4)]
    losses = [torch.full((2,), -0.0), torch.full((2,), -0.0), torch.tensor([1.5, 2.0]), torch.tensor([0.5, 4.0])]
    counts = [3, 3, 2, 2]
    rows: list[torch.Tensor] = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(clip, "_all_gather", lambda out, mine: rows.append(mine.clone()))
    for r in range(4):  # record each rank's row
        params = [SimpleNamespace(grad=SimpleNamespace(_local_tensor=t.clone())) for t in shards[r]]
        clip.clip_over_sharded_stages(params, 1e9, counts, 2, r, torch.device("cpu"), losses[r].clone())  # type: ignore[arg-type]
    every = torch.cat(rows)
    every.view(4, -1)[2:, 2] = 1e6  # stage 1's padding: read nowhere (it holds 2 parameters)
    monkeypatch.setattr(clip, "_all_gather", lambda out, mine: out.copy_(every))
    stage = [
        torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(a) ** 2 + torch.linalg.vector_norm(b) ** 2 for a, b in zip(*pair)])
            ** 0.5
        )
        for pair in (shards[:2], shards[2:])
    ]
    want = (stage[0] ** 2 + stage[1] ** 2).sqrt()
    for r in range(4):
        params = [SimpleNamespace(grad=SimpleNamespace(_local_tensor=t.clone())) for t in shards[r]]
        riders = losses[r].clone()
        norm = clip.clip_over_sharded_stages(params, 0.5, counts, 2, r, torch.device("cpu"), riders)  # type: ignore[arg-type]
        torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
        assert riders.tolist() == losses[2 + r % 2].tolist()
        coef = 0.5 / (norm + 1e-6)
        for p, t in zip(params, shards[r]):
            assert torch.equal(p.grad._local_tensor, t * coef)


if __name__ == "__main__":
    worker(sys.argv[1])
