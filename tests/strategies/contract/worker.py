"""Runs the contract scenarios for several multi-process strategies, one after another, in ONE world (each
world costs seconds of start-up per process); rank 0 writes OUT/<strategy>/results.json and tensors.safetensors.
Usage: torchrun --nproc_per_node=2 worker.py OUT STRATEGY[=DATA_SHARDS] ...; DATA_SHARDS (default: the
world size) sets the per-device batch so that the global batch is single's."""

import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

from safetensors.torch import save_file  # noqa: E402

from tests.strategies.contract.scenarios import run_all  # noqa: E402

out = sys.argv[1]
rank0 = int(os.environ.get("RANK", "0")) == 0
for entry in sys.argv[2:]:
    strategy, _, shards = entry.partition("=")
    folder = os.path.join(out, strategy)
    try:
        results, tensors = run_all(strategy, os.path.join(folder, "runs"), int(shards or os.environ["WORLD_SIZE"]))
    except Exception:  # the next strategy still runs; this one's test shows the traceback
        print(f"contract worker: {strategy} failed", file=sys.stderr, flush=True)
        results, tensors = {"error": traceback.format_exc()}, {}
    if rank0:
        os.makedirs(folder, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "tensors.safetensors"))
        with open(os.path.join(folder, "results.json"), "w") as fh:
            json.dump(results, fh)
