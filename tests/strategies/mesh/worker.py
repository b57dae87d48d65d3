"""Runs named cases of tests/strategies/mesh/cases.py on every rank; rank 0 writes results.json and
tensors.safetensors to OUT. Usage: torchrun --nproc_per_node=2 worker.py OUT CASE [CASE ...]"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

from kiln.accelerators import cpu  # noqa: E402
from tests.strategies.case_jobs import run_cases  # noqa: E402
from tests.strategies.mesh import cases  # noqa: E402

# torch computes fp16 on any CPU (slowly, without AVX512-FP16); kiln refuses it there for speed only
cpu.cpu_supports_fp16 = lambda: True
run_cases(cases.run_case, sys.argv[1], sys.argv[2:])
