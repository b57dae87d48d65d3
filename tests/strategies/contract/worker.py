"""Runs the contract scenarios on every rank of a multi-process strategy; rank 0 writes the results.
Usage: torchrun --nproc_per_node=2 worker.py STRATEGY OUT [DATA_SHARDS]; DATA_SHARDS (default: the
world size) sets the per-device batch so that the global batch is single's."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

from safetensors.torch import save_file  # noqa: E402

from tests.strategies.contract.scenarios import run_all  # noqa: E402

strategy, out = sys.argv[1], sys.argv[2]
shards = int(sys.argv[3]) if len(sys.argv) > 3 else int(os.environ.get("WORLD_SIZE", "1"))
results, tensors = run_all(strategy, os.path.join(out, "runs"), shards)
if int(os.environ.get("RANK", "0")) == 0:
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "tensors.safetensors"))
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(results, fh)
