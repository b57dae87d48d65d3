"""2-process worker for find_unused_parameters left unset: a model with an unused layer (accumulation
2, so the first window has a no_sync micro-batch before the probed one) trained with the setting
unset and with it forced on, and a model without unused parameters. Rank 0 writes OUT/results.json
and OUT/results.safetensors. Usage: torchrun --nproc_per_node=2 worker_unused.py OUT"""

import json
import os
import sys

import torch
import toy
from safetensors.torch import save_file

from kiln import Trainer

out = sys.argv[1]
results, tensors = {}, {}
for name, make, find in (
    ("auto", toy.WithUnused, None),
    ("forced", toy.WithUnused, True),
    ("all_used", toy.Regressor, None),
):
    torch.manual_seed(0)
    model = make()
    cfg = toy.scenario_config("accum", os.path.join(out, name), world=2)
    cfg["strategy"]["find_unused_parameters"] = find
    trainer = Trainer(model, cfg, train_dataset=toy.regression_data(32))
    trainer.fit()
    flat = toy.flat_params(model)
    every = trainer.strategy.all_gather(flat)
    results[name] = {
        "find_unused": trainer.model_wrapped.find_unused_parameters,
        "ranks_identical": bool((every == every[0]).all()),
        "unused_grad_is_none": model.unused.weight.grad is None if hasattr(model, "unused") else None,
    }
    tensors[name] = flat
if trainer.is_world_process_zero():
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(results, fh)
    save_file(tensors, os.path.join(out, "results.safetensors"))
