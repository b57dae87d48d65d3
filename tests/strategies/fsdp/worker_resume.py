"""Checkpoint runs of the full_shard case. Rank 0 writes the final full weights to OUT/final.safetensors.
Usage: torchrun --nproc_per_node=N worker_resume.py OUT STATE_DICT_TYPE [CHECKPOINT MAX_STEPS] [+ OUT ...]:
runs separated by `+` run one after another in the same world (one start-up for them all).

KILN_TEST_ONE_GROUP=1 builds the optimizer in one param group (as older kiln versions did without
weight decay); KILN_TEST_WEIGHT_DECAY sets weight_decay; KILN_TEST_TP=1 runs model_parallel on a tp-2 mesh
(the same case, its blocks split by tests/strategies/mesh/cases.PLAN)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

from safetensors.torch import save_file  # noqa: E402

from tests.strategies.fsdp import cases  # noqa: E402

world = int(os.environ.get("WORLD_SIZE", "1"))


def run(out: str, kind: str, *resume: str) -> None:
    extra = {"save": {"strategy": "steps", "steps": 2}, "strategy": {**cases.FSDP, "state_dict_type": kind}}
    if os.environ.get("KILN_TEST_TP"):
        from tests.strategies.mesh.cases import PLAN

        extra["strategy"] = {
            **cases.FSDP,
            "name": "model_parallel",
            "mesh": {"tp": 2},
            "tp_plan": PLAN,
            "state_dict_type": kind,
        }
    if resume:
        extra.update(resume_from_checkpoint=resume[0], max_steps=int(resume[1]))
    if os.environ.get("KILN_TEST_WEIGHT_DECAY"):
        extra["weight_decay"] = float(os.environ["KILN_TEST_WEIGHT_DECAY"])
    trainer = cases.trainer_for("full_shard", out, world, **extra)
    trainer.fit()
    weights = cases.full_weights(trainer)
    if trainer.strategy.is_global_zero:
        os.makedirs(out, exist_ok=True)
        save_file(weights, os.path.join(out, "final.safetensors"))


if os.environ.get("KILN_TEST_ONE_GROUP"):
    from kiln.optim import optimizers  # noqa: E402

    _two_groups = optimizers.parameter_groups

    def _one_group(model, weight_decay):
        return [
            {"params": [p for g in _two_groups(model, weight_decay) for p in g["params"]], "weight_decay": weight_decay}
        ]

    optimizers.parameter_groups = _one_group
runs: list[list[str]] = [[]]
for arg in sys.argv[1:]:
    if arg == "+":
        runs.append([])
    else:
        runs[-1].append(arg)
for spec in runs:
    run(*spec)

# leave the process group before interpreter shutdown (an abort at exit was seen once, see the report)
import torch.distributed as _dist  # noqa: E402

if _dist.is_initialized():
    _dist.barrier()
    _dist.destroy_process_group()
