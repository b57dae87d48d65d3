"""Counts FSDP's gradient reduce-scatters in a run of 6 steps x 2 micro-batches with 3 FSDP units
(2 blocks + the root). Rank 0 writes the count to OUT/count.json.
Usage: torchrun --nproc_per_node=2 worker_sync.py OUT"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import torch.distributed as dist  # noqa: E402

from tests.strategies.fsdp import cases  # noqa: E402

out = sys.argv[1]
calls = []
real = dist.reduce_scatter_single  # what FSDP2 calls (torch 2.13)


def counting(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)


dist.reduce_scatter_single = counting
trainer = cases.trainer_for("full_shard", out, 2)
trainer.fit()
if dist.get_rank() == 0:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "count.json"), "w") as fh:
        json.dump({"reduce_scatters": len(calls), "steps": trainer.state.global_step}, fh)

# leave the process group before interpreter shutdown (an abort at exit was seen once, see the report)
import torch.distributed as _dist  # noqa: E402

if _dist.is_initialized():
    _dist.barrier()
    _dist.destroy_process_group()
