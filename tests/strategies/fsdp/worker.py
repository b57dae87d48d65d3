"""Runs named FSDP cases on every rank; rank 0 writes results.json and tensors.safetensors to OUT.
Usage: torchrun --nproc_per_node=N worker.py OUT CASE [CASE ...]"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

from tests.strategies.case_jobs import run_cases  # noqa: E402
from tests.strategies.fsdp import cases  # noqa: E402

run_cases(cases.run_case, sys.argv[1], sys.argv[2:])
