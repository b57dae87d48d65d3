"""Runs named model_parallel cases on every rank; rank 0 writes results.json and tensors.safetensors
to OUT. Usage: torchrun --nproc_per_node=N worker.py OUT CASE[=CHECKPOINT] [...]; `CASE=CKPT` resumes
CKPT (`resume`: the default mesh; `dp2_from_tp2`: cases.resumed); `tp2` also exports with save_model
to OUT/export. Context-parallel cases are cp_cases.py's."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

from tests.strategies.case_jobs import run_cases  # noqa: E402
from tests.strategies.model_parallel import cases, cp_cases  # noqa: E402


def run_case(entry: str, root: str, world: int) -> tuple:
    name, _, checkpoint = entry.partition("=")
    extra = {"resume_from_checkpoint": checkpoint} if checkpoint else {}
    if cp_cases.handles(name):
        return cp_cases.run_case(name, root, **extra)
    export = os.path.join(sys.argv[1], "export") if name == "tp2" else None
    return cases.run_case(name, root, export=export, **extra)


run_cases(run_case, sys.argv[1], sys.argv[2:])
