"""One 2-process launch runs every DeepSpeed check (they share the 2 CPU cores): fp32 parity of ZeRO
0-3 with DDP (accumulation 2, clipping, uneven token counts), bf16 under ZeRO-2/3, resume under ZeRO-2/3
and `kiln convert`, and the refusal of a checkpoint in another optimizer param-group layout. Rank 0 writes results.json and tensors.safetensors.
Usage: torchrun --nproc_per_node=2 worker.py OUT [CHECK ...]"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.strategies.contract.scenarios import full_weights, trainer_for  # noqa: E402

out = sys.argv[1]
checks = sys.argv[2:] or ["parity", "bf16", "resume", "layouts"]
world = int(os.environ["WORLD_SIZE"])
rank = int(os.environ["RANK"])
root = os.path.join(out, "runs")
results: dict = {}
tensors: dict = {}


def ds(stage: int, **more):
    return {"deepspeed": {"zero_optimization": {"stage": stage}, **more}}


if "parity" in checks:
    for key, strategy, extra in [("ddp", "ddp", {}), *[(f"zero{s}", "deepspeed", ds(s)) for s in range(4)]]:
        trainer = trainer_for(strategy, root, key, world, **extra)
        trainer.fit()
        results[key] = {
            "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "eval_loss": trainer.evaluate()["eval_loss"],
        }
        tensors.update({f"{key}/{k}": v for k, v in full_weights(trainer).items()})

if "bf16" in checks:
    for stage in (2, 3):
        key = f"bf16_zero{stage}"
        trainer = trainer_for("deepspeed", root, key, world, bf16=True, **ds(stage))
        before = full_weights(trainer)
        trainer.fit()
        after = full_weights(trainer)
        results[key] = {
            "eval_loss": trainer.evaluate()["eval_loss"],
            "param_dtype": str(next(trainer.model.parameters()).dtype),
            "moved": max(float((after[k] - before[k]).abs().max()) for k in before),
        }

if "resume" in checks:
    from kiln.engine.checkpoint.convert import convert_checkpoint as convert

    save = {"save": {"strategy": "steps", "steps": 2}}
    for stage in (2, 3):
        key = f"resume_zero{stage}"
        whole = trainer_for("deepspeed", root, key, world, **save, **ds(stage))
        whole.fit()  # uninterrupted; its checkpoint-2 is where the "killed" run restarts
        live = full_weights(whole)
        resumed = trainer_for(
            "deepspeed",
            root,
            key + "_b",
            world,
            resume_from_checkpoint=os.path.join(root, key, "checkpoint-2"),
            **ds(stage),
        )
        resumed.fit()
        tensors.update({f"{key}/whole/{k}": v for k, v in live.items()})
        tensors.update({f"{key}/resumed/{k}": v for k, v in full_weights(resumed).items()})
        results[key] = {"steps": resumed.state.global_step}
        if rank == 0:  # kiln convert: zero_to_fp32 over the shards, in one process
            path = convert(os.path.join(root, key, "checkpoint-6"), os.path.join(out, f"converted{stage}"))
            from safetensors.torch import load_file

            tensors.update({f"{key}/converted/{k}": v for k, v in load_file(path).items()})

if "layouts" in checks:  # a checkpoint of older kiln's one-group layout resumed in today's two groups (HF's)
    from kiln.optim import optimizers

    two_groups, save = optimizers.parameter_groups, {"save": {"strategy": "steps", "steps": 2}}

    def one_group(model, weight_decay):
        return [
            {"params": [p for g in two_groups(model, weight_decay) for p in g["params"]], "weight_decay": weight_decay}
        ]

    for stage in (0, 3):
        key = f"layout_zero{stage}"
        optimizers.parameter_groups = one_group
        old = trainer_for("deepspeed", root, key, world, **save, **ds(stage))
        old.fit()
        optimizers.parameter_groups = two_groups
        try:
            resumed = trainer_for(
                "deepspeed",
                root,
                key + "_b",
                world,
                resume_from_checkpoint=os.path.join(root, key, "checkpoint-2"),
                **ds(stage),
            )
            resumed.fit()
            results[key] = {"error": None, "groups": len(resumed.optimizer.param_groups)}
            tensors.update({f"{key}/resumed/{k}": v for k, v in full_weights(resumed).items()})
        except Exception as err:  # noqa: BLE001
            results[key] = {"error": f"{type(err).__name__}: {err}"}
            torch.distributed.barrier()
        tensors.update({f"{key}/whole/{k}": v for k, v in full_weights(old).items()})

if rank == 0:
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "tensors.safetensors"))
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(results, fh)
