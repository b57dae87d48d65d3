"""Shards one Linear(4 -> 8) weight under every FSDP sharding option on this process group and
records, per option, the device mesh and the local shard of the weight. Rank 0 writes OUT/mesh.json.
Usage: torchrun --nproc_per_node=2 worker_mesh.py OUT"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

from torch import nn  # noqa: E402

from kiln.config.load import load_config  # noqa: E402
from kiln.precision.fp32 import FP32Precision  # noqa: E402
from kiln.strategies.fsdp.strategy import FSDPStrategy  # noqa: E402

#: case name -> strategy settings beside name/device
OPTIONS = {
    "full_shard": {"sharding": "full_shard"},
    "shard_grad_op": {"sharding": "shard_grad_op"},
    "hybrid_shard": {"sharding": "hybrid_shard"},
    "hybrid_shard_zero2": {"sharding": "hybrid_shard_zero2"},
    "hybrid_shard_size1": {"sharding": "hybrid_shard", "shard_size": 1},
    "no_shard": {"sharding": "no_shard"},
}

out = sys.argv[1]
owner = None
results = {}
for case, settings in OPTIONS.items():
    strategy = FSDPStrategy(load_config({"strategy": {"name": "fsdp", "device": "cpu", **settings}}), FP32Precision())
    strategy.setup_environment()  # the first one creates the group, the others join it
    owner = owner or strategy
    model = strategy.setup_module(nn.Sequential(nn.Linear(4, 8, bias=False)))
    weight = model[0].weight
    results[case] = {
        "mesh": list(weight.device_mesh.shape),
        "dims": list(weight.device_mesh.mesh_dim_names or []),
        "local": list(weight.to_local().shape),
        "full": list(weight.shape),
        "placements": [type(p).__name__ for p in weight.placements],
    }
if owner.global_rank == 0:
    with open(os.path.join(out, "mesh.json"), "w") as fh:
        json.dump(results, fh)
owner.barrier("done")
owner.teardown()
