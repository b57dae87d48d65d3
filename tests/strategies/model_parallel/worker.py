"""Runs named model_parallel cases on every rank; rank 0 writes results.json and tensors.safetensors
to OUT. Usage: torchrun --nproc_per_node=N worker.py OUT CASE[=CHECKPOINT] [...]; `CASE=CKPT` resumes
CKPT (`resume`: the default mesh; `dp2_from_tp2`: cases.resumed); `tp2` also exports with save_model
to OUT/export. Context-parallel cases are cp_cases.py's."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

from safetensors.torch import save_file  # noqa: E402

from tests.strategies.model_parallel import cases, cp_cases  # noqa: E402

out, names = sys.argv[1], sys.argv[2:]
results, tensors = {}, {}
for entry in names:
    name, _, checkpoint = entry.partition("=")
    print("CASE", name, file=sys.stderr, flush=True)
    extra = {"resume_from_checkpoint": checkpoint} if checkpoint else {}
    export = os.path.join(out, "export") if name == "tp2" else None
    if cp_cases.handles(name):
        results[name], weights = cp_cases.run_case(name, os.path.join(out, "runs"), **extra)
    else:
        results[name], weights = cases.run_case(name, os.path.join(out, "runs"), export=export, **extra)
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
