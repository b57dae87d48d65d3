"""2-process worker: every numeric scenario of toy.SCENARIOS under DDP, then evaluation and
prediction on an uneven dataset. Rank 0 writes results to OUT; the parent compares them with
1-process runs. Usage: torchrun --nproc_per_node=2 worker_parity.py OUT"""

import json
import os
import sys

import torch
import torch.distributed as dist
import toy
from omegaconf import read_write
from safetensors.torch import save_file

out = sys.argv[1]
results: dict = {}
tensors: dict = {}
for name in toy.SCENARIOS:
    trainer, model = toy.train_scenario(name, os.path.join(out, name), world=2)
    flat = toy.flat_params(model)
    every = trainer.strategy.all_gather(flat)
    results[name] = {
        "losses": toy.losses(trainer),
        "ranks_identical": bool((every == every[0]).all()),
        "strategy": type(trainer.strategy).__name__,
        "wrapped": type(trainer.model_wrapped).__name__,
        "train_loss": trainer.state.log_history[-1].get("train_loss"),
        "float8_layers": sum(type(m).__name__ == "Float8Linear" for m in model.modules()),
    }
    tensors[name] = flat

# evaluation / prediction through the DDP-wrapped model, 7 samples over 2 ranks
trainer, model = toy.train_scenario("plain", os.path.join(out, "eval"), world=2)
tensors["eval_params"] = toy.flat_params(model)
data = toy.regression_data(7, seed=11)
for batch in (1, 3):
    with read_write(trainer.config):  # read-only once loaded
        trainer.config.data.per_device_eval_batch_size = batch
    metrics = trainer.evaluate(data)
    pred = trainer.predict(data)
    results[f"eval_b{batch}"] = {"eval_loss": metrics["eval_loss"], "num_predictions": len(pred.predictions)}
    tensors[f"pred_b{batch}"] = torch.as_tensor(pred.predictions)
    tensors[f"labels_b{batch}"] = torch.as_tensor(pred.label_ids)
results["ranks"] = trainer.strategy.all_gather_object(
    {"rank": dist.get_rank(), "world": trainer.is_world_process_zero(), "local": trainer.is_local_process_zero()}
)
if dist.get_rank() == 0:
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "results.safetensors"))
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(results, fh)
