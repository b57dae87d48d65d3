"""2-process worker for tests/distributed/test_ddp_batches.py: trains every batches_toy scenario under
DDP; rank 0 writes the weights and per-rank facts to OUT. Usage: torchrun ... worker_batches.py OUT"""

import json
import os
import shutil
import sys

import batches_toy
import torch.distributed as dist
import toy
from safetensors.torch import save_file

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
results: dict = {}
tensors: dict = {}
for name in batches_toy.SCENARIOS:
    batches_toy.ITERATIONS.clear()
    trainer, model = batches_toy.train(name, os.path.join(out, name), world=2)
    flat = toy.flat_params(model)
    every = trainer.strategy.all_gather(flat)
    loader = trainer.get_train_dataloader()
    results[name] = {
        "ranks_identical": bool((every == every[0]).all()),
        "steps": trainer.state.global_step,
        "losses": toy.losses(trainer),
        "per_rank": trainer.strategy.all_gather_object(
            {"iterations": len(batches_toy.ITERATIONS), "batch_size": getattr(loader, "batch_size", None)}
        ),
        "eval_batch_size": trainer.get_eval_dataloader(toy.regression_data(8)).batch_size,
    }
    tensors[name] = flat
    first = next(iter(loader))["x"]  # every rank iterates (dispatch broadcasts), so this is collective-safe
    for rank, x in enumerate(trainer.strategy.all_gather_object(first)):
        tensors[f"{name}_first_{rank}"] = x
# resume mid-epoch from a dispatched stream: rank 0 reads past the first 3 batches, every rank follows
for name in ("dispatch", "split"):
    full = os.path.join(out, f"{name}_full")
    _, model = batches_toy.train(name, full, world=2, save_steps=3, save_strategy="steps")
    resumed_dir = os.path.join(out, f"{name}_resumed")
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(full, "checkpoint-3"), os.path.join(resumed_dir, "checkpoint-3"))
    dist.barrier()
    _, resumed = batches_toy.train(name, resumed_dir, world=2, resume=True, save_steps=3, save_strategy="steps")
    results[f"{name}_resume_exact"] = bool(toy.flat_params(resumed).equal(toy.flat_params(model)))
if dist.get_rank() == 0:
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "results.safetensors"))
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(results, fh)
