"""The device mesh each FSDP sharding option builds, and the local shard each rank then holds.

The parity tests compare weights, which every option gets right: hybrid_shard on one node with the
mesh's two sizes swapped replicates instead of sharding (and no_shard starts sharding), with identical
numbers on 2 CPU processes. So the mesh shape and the local shard sizes are asserted directly: on a
real 2-process group, and for multi-node worlds (which this machine cannot start) through the sizes
`mesh()` hands to `init_device_mesh`."""

from __future__ import annotations

import json

import pytest

from kiln.config.load import load_config
from kiln.precision.fp32 import FP32Precision
from kiln.launch.environment import ClusterEnvironment
from kiln.strategies.fsdp.strategy import FSDPStrategy
from tests.strategies.fsdp.conftest import torchrun


def _mesh_request(monkeypatch: pytest.MonkeyPatch, world: int, per_node: int, **settings) -> tuple:
    """(sizes, dim names) that FSDPStrategy.mesh() asks init_device_mesh for, in a world of `world`
    processes with `per_node` on each node."""
    import torch.distributed.device_mesh as device_mesh

    asked = []
    monkeypatch.setattr(device_mesh, "init_device_mesh",
                        lambda device, shape, mesh_dim_names=None: asked.append((tuple(shape), mesh_dim_names)))
    strategy = FSDPStrategy(load_config({"strategy": {"name": "fsdp", "device": "cpu", **settings}}), FP32Precision())
    strategy.world_size = world
    strategy.cluster = ClusterEnvironment(world_size=world, local_world_size=per_node, num_nodes=world // per_node)
    strategy.mesh()
    (request,) = asked
    return request


@pytest.mark.parametrize("world,per_node,settings,want", [
    (8, 4, {"sharding": "full_shard"}, (8,)),
    (8, 4, {"sharding": "shard_grad_op"}, (8,)),
    (8, 4, {"sharding": "hybrid_shard"}, (2, 4)),  # shard inside each 4-process node, replicate across 2 nodes
    (8, 4, {"sharding": "hybrid_shard_zero2"}, (2, 4)),
    (8, 2, {"sharding": "hybrid_shard"}, (4, 2)),
    (8, 4, {"sharding": "hybrid_shard", "shard_size": 2}, (4, 2)),  # shard_size wins over the node size
    (4, 4, {"sharding": "hybrid_shard"}, (1, 4)),  # one node: hybrid_shard shards like full_shard
    (8, 4, {"sharding": "no_shard"}, (8, 1)),  # replicate only
])
def test_mesh_sizes_for_multi_node_worlds(monkeypatch, world, per_node, settings, want):
    shape, names = _mesh_request(monkeypatch, world, per_node, **settings)
    assert shape == want
    assert names == (None if len(want) == 1 else ("replicate", "shard"))


@pytest.mark.distributed
def test_mesh_and_local_shards_on_two_processes(tmp_path):
    """Linear(4 -> 8).weight, sharded on dim 0: 4 rows per rank when sharded 2 ways, all 8 when replicated."""
    torchrun(2, "worker_mesh.py", tmp_path, timeout=300)
    got = json.loads((tmp_path / "mesh.json").read_text())
    sharded_2d = {"mesh": [1, 2], "dims": ["replicate", "shard"], "local": [4, 4], "full": [8, 4],
                  "placements": ["Replicate", "Shard"]}
    replicated = {"mesh": [2, 1], "dims": ["replicate", "shard"], "local": [8, 4], "full": [8, 4],
                  "placements": ["Replicate", "Shard"]}
    sharded_1d = {"mesh": [2], "dims": [], "local": [4, 4], "full": [8, 4], "placements": ["Shard"]}
    assert got == {"full_shard": sharded_1d, "shard_grad_op": sharded_1d, "hybrid_shard": sharded_2d,
                   "hybrid_shard_zero2": sharded_2d, "hybrid_shard_size1": replicated, "no_shard": replicated}
