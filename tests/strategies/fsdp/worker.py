"""Runs named FSDP cases on every rank; rank 0 writes results.json and tensors.safetensors to OUT.
Usage: torchrun --nproc_per_node=N worker.py OUT CASE [CASE ...]"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

from safetensors.torch import save_file  # noqa: E402

from tests.strategies.fsdp import cases  # noqa: E402

out, names = sys.argv[1], sys.argv[2:]
world = int(os.environ.get("WORLD_SIZE", "1"))
results, tensors = {}, {}
for name in names:
    print("CASE", name, file=sys.stderr, flush=True)
    results[name], weights = cases.run_case(name, os.path.join(out, "runs"), world)
    tensors.update({f"{name}/{k}": v.contiguous() for k, v in weights.items()})
if int(os.environ.get("RANK", "0")) == 0:
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "tensors.safetensors"))
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(results, fh)

# leave the process group before interpreter shutdown (an abort at exit was seen once, see the report)
import torch.distributed as _dist  # noqa: E402

if _dist.is_initialized():
    _dist.barrier()
    _dist.destroy_process_group()
