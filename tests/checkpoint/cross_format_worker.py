"""The 2-process leg of tests/checkpoint/test_cross_format_resume.py, every run in one gloo world.
Usage: torchrun --nproc_per_node=2 cross_format_worker.py ROOT

- ROOT/chain: FSDP (sharded) resumes the single-process `full` checkpoint ROOT/chain/checkpoint-2, with
  half the per-device batch (the same global batch), and saves checkpoint-4 in its own format.
- ROOT/ddp: DDP trains to step 4 uninterrupted (its checkpoint-2 and -4 in format `full`); ROOT/fsdp: FSDP
  (state_dict_type full) resumes a copy of that checkpoint-2 and saves checkpoint-4."""

import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import torch.distributed as dist  # noqa: E402

from tests.checkpoint.test_cross_format_resume import CHAIN, fit  # noqa: E402

root = sys.argv[1]
fit(
    os.path.join(root, "chain"),
    "fsdp-sharded",
    os.path.join(root, "chain", "checkpoint-2"),
    **CHAIN,
    batch=2,
    crash_at=4,
)
fit(os.path.join(root, "ddp"), "ddp", None, **CHAIN, batch=2, crash_at=4)
if int(os.environ["RANK"]) == 0:
    os.makedirs(os.path.join(root, "fsdp"))
    shutil.copytree(os.path.join(root, "ddp", "checkpoint-2"), os.path.join(root, "fsdp", "checkpoint-2"))
dist.barrier()
fit(os.path.join(root, "fsdp"), "fsdp-full", os.path.join(root, "fsdp", "checkpoint-2"), **CHAIN, batch=2, crash_at=4)
dist.destroy_process_group()
