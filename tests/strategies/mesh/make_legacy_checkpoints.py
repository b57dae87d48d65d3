"""Writes the checkpoints tests/strategies/mesh/test_legacy_formats.py resumes: a 2-process run of each
preset as kiln wrote it before fsdp and model_parallel became presets of one mesh strategy (format
"fsdp-sharded" from `strategy: fsdp`, format "model-parallel-dcp" from `strategy: model_parallel` with
tp 2), each saved at step 2 of 4, beside the weights and losses of the run that never stopped.

Run with the kiln of commit 72e154f (before the change), from a checkout of it:

    git -C /work/wt/mesh archive 72e154f | tar -x -C /tmp/kiln_old
    PYTHONPATH=/tmp/kiln_old python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/strategies/mesh/make_legacy_checkpoints.py tests/strategies/mesh/legacy
"""

import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

from kiln import Trainer
from tests.helpers import padded_token_data
from tests.strategies.fsdp.cases import TinyLM

#: TinyLM's blocks as one TP region each: `up` split by its outputs (tanh works on the split), `down`
#: by its inputs (its outputs summed whole)
PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
#: format -> (strategy, data shards)
RUNS = {
    "fsdp-sharded": ({"name": "fsdp", "device": "cpu", "wrap": ["Block"]}, 2),
    "model-parallel-dcp": ({"name": "model_parallel", "device": "cpu", "mesh": {"tp": 2}, "tp_plan": PLAN}, 1),
}


def config(fmt: str, out: str, **extra) -> dict:
    strategy, shards = RUNS[fmt]
    cfg = {
        "output_dir": out,
        "seed": 3,
        "learning_rate": 0.02,
        "max_steps": 4,
        "per_device_train_batch_size": 4 // shards,
        "gradient_accumulation_steps": 2,
        "max_grad_norm": 0.3,
        "save": {"strategy": "steps", "steps": 2},
        "log": {"history": [], "disable_tqdm": True, "steps": 1},
        "strategy": strategy,
    }
    cfg.update(extra)
    return cfg


def trainer(cfg: dict) -> Trainer:
    torch.manual_seed(0)
    return Trainer(TinyLM(), cfg, train_dataset=padded_token_data(48, 10, 11, seed=1))


def main(folder: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    for fmt in RUNS:
        run = os.path.join(folder, "runs", fmt)
        t = trainer(config(fmt, run))
        t.fit()
        weights = {k: v.detach().float().contiguous() for k, v in t.strategy.model_state_for_export(t.model).items()}
        losses = [h["loss"] for h in t.state.log_history if "loss" in h]
        if rank == 0:
            target = os.path.join(folder, fmt)
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(os.path.join(run, "checkpoint-2"), os.path.join(target, "checkpoint-2"))
            save_file(weights, os.path.join(target, "final.safetensors"))
            with open(os.path.join(target, "losses.json"), "w") as fh:
                json.dump(losses, fh)
        t.strategy.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(folder, "runs"))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
