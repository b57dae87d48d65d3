"""Runs named cases of tests/strategies/mesh/cases.py on every rank; rank 0 writes results.json and
tensors.safetensors to OUT. Usage: torchrun --nproc_per_node=2 worker.py OUT CASE [CASE ...]"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

from safetensors.torch import save_file  # noqa: E402

from kiln.accelerators import cpu  # noqa: E402
from tests.strategies.mesh import cases  # noqa: E402

# torch computes fp16 on any CPU (slowly, without AVX512-FP16); kiln refuses it there for speed only
cpu.cpu_supports_fp16 = lambda: True

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

import torch.distributed as _dist  # noqa: E402

if _dist.is_initialized():
    _dist.barrier()
    _dist.destroy_process_group()
