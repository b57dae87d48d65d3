"""2-process worker: auto_find_batch_size when only rank 1 runs out of memory (above 5 samples). Both
ranks must settle on 5 without hanging, and end where a DDP run configured with 5 ends. Rank 0
writes results to OUT. Usage: torchrun --nproc_per_node=2 worker_auto_batch.py OUT"""

import json
import os
import sys

import torch
import torch.distributed as dist
import toy

out = sys.argv[1]


class RankOneIsSmall(toy.Regressor):
    def training_step(self, batch):
        if dist.get_rank() == 1 and batch["x"].shape[0] > 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().training_step(batch)


def run(name: str, batch: int, auto: bool):
    from kiln import Trainer

    torch.manual_seed(0)
    model = RankOneIsSmall(dropout=0.2)
    cfg = toy.scenario_config(
        "plain",
        os.path.join(out, name),
        world=2,
        per_device_train_batch_size=batch,
        auto_find_batch_size=auto,
        max_steps=4,
    )
    trainer = Trainer(model, cfg, train_dataset=toy.regression_data(48))
    trainer.fit()
    return trainer, toy.flat_params(model)


auto, auto_params = run("auto", 8, True)
fixed, fixed_params = run("fixed", 5, False)
sizes = auto.strategy.all_gather_object(auto._train_batch_size)
if dist.get_rank() == 0:
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump({"sizes": sizes, "equal": bool(torch.equal(auto_params, fixed_params))}, fh)
