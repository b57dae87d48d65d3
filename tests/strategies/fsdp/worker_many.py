"""Several FSDP scenarios in one 2-process job (starting a job costs more than most scenarios):
each named worker module's `main(OUT/<name>)` runs in turn, on every rank.
Usage: torchrun --nproc_per_node=2 worker_many.py OUT NAME [NAME ...]   (NAME: loading, generate, direct, precision)"""

import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import torch.distributed as dist  # noqa: E402

out, names = sys.argv[1], sys.argv[2:]
for name in names:
    print("SCENARIO", name, file=sys.stderr, flush=True)
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    importlib.import_module(f"tests.strategies.fsdp.worker_{name}").main(folder)
    dist.barrier()
dist.destroy_process_group()
