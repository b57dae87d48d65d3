"""Trains a tied-embedding Transformers model for 2 steps under each named strategy on every rank and
exports it with `trainer.save_model(OUT/<case>)`; rank 0 also writes the weights the strategy gathered
(OUT/<case>.safetensors, each tie stored as its own copy). Usage:
torchrun --nproc_per_node=2 worker.py OUT CASE [CASE ...]   (CASE: see cases.CASES)"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

from safetensors.torch import save_file  # noqa: E402

from tests.strategies.export import cases  # noqa: E402

out, names = sys.argv[1], sys.argv[2:]
for name in names:
    print("CASE", name, file=sys.stderr, flush=True)
    weights = cases.train_and_export(name, out, int(os.environ.get("WORLD_SIZE", "1")))
    if int(os.environ.get("RANK", "0")) == 0:
        save_file({k: v.clone().contiguous() for k, v in weights.items()}, os.path.join(out, f"{name}.safetensors"))

import torch.distributed as _dist  # noqa: E402

if _dist.is_initialized():
    _dist.barrier()
    _dist.destroy_process_group()
