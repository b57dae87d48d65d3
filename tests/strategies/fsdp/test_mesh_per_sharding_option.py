"""The device mesh each FSDP sharding option builds, and the local shard each rank then holds.

The parity tests compare weights, which every option gets right: hybrid_shard on one node with the
mesh's two sizes swapped replicates instead of sharding (and no_shard starts sharding), with identical
numbers on 2 CPU processes. So the mesh shape and the local shard sizes are asserted directly: on a
real 2-process group, and for multi-node worlds (which this machine cannot start) through the mesh
the preset asks the mesh strategy for (`parallel_dims`)."""

from __future__ import annotations

import json

import pytest

from kiln.config.load import load_config
from kiln.launch.environment import ClusterEnvironment
from kiln.precision.fp32 import FP32Precision
from kiln.strategies.fsdp.strategy import FSDPStrategy
from kiln.strategies.mesh.dims import ParallelDims
from tests.strategies.fsdp.conftest import torchrun


def _dims(world: int, per_node: int, tp: int = 1, shard_size: int | None = None, **settings) -> ParallelDims:
    """The mesh FSDPStrategy asks for in a world of `world` processes with `per_node` on each node."""
    strategy = FSDPStrategy(load_config({"strategy": {"name": "fsdp", "device": "cpu", **settings}}), FP32Precision())
    strategy.settings.tp, strategy.settings.shard_size = tp, shard_size  # sizes this one process could not divide
    strategy.cluster = ClusterEnvironment(world_size=world, local_world_size=per_node, num_nodes=world // per_node)
    return strategy.parallel_dims(world)


@pytest.mark.parametrize(
    "world,per_node,settings,want",
    [
        (8, 4, {"sharding": "full_shard"}, {"dp_shard": 8}),
        (8, 4, {"sharding": "shard_grad_op"}, {"dp_shard": 8}),
        (8, 4, {"sharding": "hybrid_shard"}, {"dp_replicate": 2, "dp_shard": 4}),  # shard inside each 4-process node
        (8, 4, {"sharding": "hybrid_shard_zero2"}, {"dp_replicate": 2, "dp_shard": 4}),
        (8, 2, {"sharding": "hybrid_shard"}, {"dp_replicate": 4, "dp_shard": 2}),
        (8, 4, {"sharding": "hybrid_shard", "shard_size": 2}, {"dp_replicate": 4, "dp_shard": 2}),  # shard_size wins
        (4, 4, {"sharding": "hybrid_shard"}, {"dp_shard": 4}),  # one node: hybrid_shard shards like full_shard
        (8, 4, {"sharding": "no_shard"}, {"dp_replicate": 8}),  # replicate only
        (
            8,
            4,
            {"sharding": "full_shard", "tp": 2},
            {"dp_shard": 4, "tp": 2},
        ),  # tp takes its axis, the sharding the rest
        (8, 4, {"sharding": "hybrid_shard", "tp": 2}, {"dp_replicate": 2, "dp_shard": 2, "tp": 2}),  # a node: 2 x tp 2
        (8, 4, {"sharding": "no_shard", "tp": 4}, {"dp_replicate": 2, "tp": 4}),
    ],
)
def test_mesh_sizes_for_multi_node_worlds(world, per_node, settings, want):
    assert _dims(world, per_node, **settings) == ParallelDims(**want)


@pytest.mark.distributed
def test_mesh_and_local_shards_on_two_processes(tmp_path):
    """Linear(4 -> 8).weight, sharded on dim 0: 4 rows per rank when sharded 2 ways, all 8 when replicated."""
    torchrun(2, "worker_mesh.py", tmp_path, timeout=300)
    got = json.loads((tmp_path / "mesh.json").read_text())
    replicated = {
        "mesh": [2, 1],
        "dims": ["dp_replicate", "dp_shard"],
        "local": [8, 4],
        "full": [8, 4],
        "placements": ["Replicate", "Shard"],
    }
    sharded = {"mesh": [2], "dims": ["dp_shard"], "local": [4, 4], "full": [8, 4], "placements": ["Shard"]}
    # hybrid_shard on one node: {dp_replicate: 1, dp_shard: 2}, FSDP over dp_shard alone, as full_shard
    assert got == {
        "full_shard": sharded,
        "shard_grad_op": sharded,
        "hybrid_shard": sharded,
        "hybrid_shard_zero2": sharded,
        "hybrid_shard_size1": replicated,
        "no_shard": replicated,
    }
