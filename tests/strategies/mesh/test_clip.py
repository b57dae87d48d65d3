"""clip.py's norm across meshes without a world (world 1: no all-reduce): each gradient's squares weighted
by the share of the ranks holding it, every dtype's gradients scaled by the same factor, bitwise the
per-tensor arithmetic (`x * 1.0` left out, one multiply-in-place call per dtype)."""

from __future__ import annotations

import torch

from kiln.strategies.mesh.clip import clip_across_meshes


def test_clip_across_meshes_weighs_each_gradient_and_scales_every_dtype():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g).bfloat16(), torch.randn(4, generator=g)]
    want = [t.clone() for t in grads]
    norm = clip_across_meshes(grads, 0.5, holders=2, world=1, device=torch.device("cpu"))
    total = torch.zeros(())
    for t in want:  # a plain gradient: every one of the 2 holders counts half of its squares
        total += t.float().pow(2).sum() * 0.5
    assert torch.equal(norm, total.sqrt())
    coef = torch.clamp(0.5 / (norm + 1e-6), max=1.0)
    assert coef < 1.0  # it clips
    for got, t in zip(grads, want):
        assert got.dtype == t.dtype and torch.equal(got, t * coef.to(t.dtype))
    one = [torch.randn(3, generator=g)]
    before = one[0].clone()
    norm = clip_across_meshes(one, 1e9, holders=1, world=1, device=torch.device("cpu"))
    assert torch.equal(norm, before.pow(2).sum().sqrt()) and torch.equal(one[0], before)  # weight 1, no clip


def test_clip_across_meshes_counts_a_shard_once_and_a_replica_by_its_holders():
    """On one rank of a fake world of 2 (its all-reduce a no-op, so the norm is this rank's share): a
    gradient sharded over the 2 ranks counts its local squares whole, one replicated over them half,
    as a plain gradient held by both; every local piece is scaled."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        g = torch.Generator().manual_seed(0)
        pieces = [torch.randn(3, 4, generator=g) for _ in range(3)]
        grads = [
            DTensor.from_local(pieces[0].clone(), mesh, [Shard(0)], run_check=False),
            DTensor.from_local(pieces[1].clone(), mesh, [Replicate()], run_check=False),
            pieces[2].clone(),
        ]
        norm = clip_across_meshes(grads, 0.1, holders=2, world=2, device=torch.device("cpu"))
        want = pieces[0].pow(2).sum() + pieces[1].pow(2).sum() * 0.5 + pieces[2].pow(2).sum() * 0.5
        torch.testing.assert_close(norm, want.sqrt())
        coef = torch.clamp(0.1 / (norm + 1e-6), max=1.0)
        locals_ = [grads[0].to_local(), grads[1].to_local(), grads[2]]
        assert all(torch.equal(got, piece * coef) for got, piece in zip(locals_, pieces))
    finally:
        dist.destroy_process_group()
