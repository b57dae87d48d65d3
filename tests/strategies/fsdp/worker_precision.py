"""fp16 (with its loss scaler) and bf16-true under FSDP on every rank. In the fp16 run an inf is put
into ONE element of rank 0's gradient shard before step 2's optimizer step, so only rank 0 can see it
locally. Rank 0 writes OUT/result.json with every rank's observations.
Run by worker_many.py (`main(OUT)` on every rank)"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kiln import Callback  # noqa: E402
from kiln.accelerators import cpu  # noqa: E402
from tests.strategies.fsdp import cases  # noqa: E402

INF_STEP = 1
# torch computes fp16 on any CPU (slowly, without AVX512-FP16); kiln refuses it there for speed only
cpu.cpu_supports_fp16 = lambda: True  # global_step before the poisoned optimizer step


class Watch(Callback):
    """Per optimizer step: did this rank's shards change, and the loss scale before and after."""

    def __init__(self, trainer, poison: bool) -> None:
        self.trainer, self.poison, self.steps = trainer, poison, []

    def _locals(self):
        return [p.to_local().detach().clone() for p in self.trainer.model.parameters()]

    def on_pre_optimizer_step(self, config, state, control, **kw):
        scaler = getattr(self.trainer.precision, "scaler", None) if self.trainer.precision.uses_grad_scaler else None
        self.before = (self._locals(), scaler.get_scale() if scaler else None)
        if self.poison and state.global_step == INF_STEP and dist.get_rank() == 0:
            grad = self.trainer.model.head.weight.grad.to_local()
            grad.view(-1)[0] = float("inf")

    def on_optimizer_step(self, config, state, control, **kw):
        params, scale = self.before
        scaler = getattr(self.trainer.precision, "scaler", None) if self.trainer.precision.uses_grad_scaler else None
        changed = any(not torch.equal(a, b) for a, b in zip(params, self._locals()))
        self.steps.append(
            {"changed": changed, "scale_before": scale, "scale_after": scaler.get_scale() if scaler else None}
        )


def run(out: str, name: str, poison: bool, **extra):
    trainer = cases.trainer_for("full_shard", os.path.join(out, name), 2, max_grad_norm=0.0, **extra)
    watch = Watch(trainer, poison)
    trainer.add_callback(watch)
    trainer.fit()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    facts = {
        "steps": watch.steps,
        "losses": losses,
        "precision": type(trainer.precision).__name__,
        "scaler": type(trainer.precision.scaler).__name__ if trainer.precision.uses_grad_scaler else None,
        "skipped": getattr(trainer.precision, "skipped_steps", 0),
        "shard_dtypes": sorted({str(p.to_local().dtype) for p in trainer.model.parameters()}),
        "sharded": all(p.to_local().numel() < p.numel() for p in trainer.model.parameters() if p.numel() > 1),
    }
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, facts)
    return every


def main(out: str) -> None:
    # torch computes fp16 on any CPU (slowly, without AVX512-FP16); kiln refuses it there for speed only
    cpu.cpu_supports_fp16 = lambda: True
    result = {
        "fp16": run(out, "fp16", True, fp16=True),
        "bf16-true": run(out, "bf16_true", False, precision="bf16-true"),
    }
    if dist.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as fh:
            json.dump(result, fh)
