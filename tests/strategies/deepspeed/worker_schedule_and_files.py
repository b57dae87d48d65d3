"""2-process DeepSpeed runs whose results parity cannot see: the learning rate of every step when
DeepSpeed's config has its own scheduler (kiln must step it once per optimizer step, DeepSpeed's engine
must not step it again), and a ZeRO-3 checkpoint's folder (the full weights must be in it, since
ZeRO-3's own model file holds none). Rank 0 writes results.json and tensors.safetensors.
Usage: torchrun --nproc_per_node=2 worker_schedule_and_files.py OUT"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from safetensors.torch import save_file  # noqa: E402

from tests.strategies.contract.scenarios import full_weights, trainer_for  # noqa: E402

out = sys.argv[1]
world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
root = os.path.join(out, "runs")
results: dict = {}
tensors: dict = {}

# DeepSpeed's WarmupDecayLR, its numbers filled from kiln's (learning_rate, warmup_steps, max_steps)
sched = {
    "type": "WarmupDecayLR",
    "params": {
        "warmup_min_lr": "auto",
        "warmup_max_lr": "auto",
        "warmup_num_steps": "auto",
        "total_num_steps": "auto",
        "warmup_type": "linear",
    },
}
trainer = trainer_for(
    "deepspeed",
    root,
    "schedule",
    world,
    learning_rate=0.01,
    warmup_steps=4,
    max_steps=8,
    deepspeed={"zero_optimization": {"stage": 2}, "scheduler": sched},
)
trainer.fit()
results["schedule"] = {
    "params": trainer.strategy.ds_config["scheduler"]["params"],
    "lrs": [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h],
    "steps": trainer.state.global_step,
}

# ZeRO-3 (every parameter partitioned), saved at its last step: its live full weights are the checkpoint's
zero3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
trainer = trainer_for(
    "deepspeed",
    root,
    "zero3",
    world,
    max_steps=2,
    save={"strategy": "steps", "steps": 2},
    deepspeed={"zero_optimization": zero3},
)
trainer.fit()
tensors.update({f"zero3/{k}": v for k, v in full_weights(trainer).items()})
results["zero3"] = {"checkpoint": os.path.join(root, "zero3", "checkpoint-2")}

if rank == 0:
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "tensors.safetensors"))
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(results, fh)
