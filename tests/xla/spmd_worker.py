"""Runs in its own process with CPU_NUM_DEVICES=2 (SPMD switches the whole process over, so it
cannot share one with the single-device tests). Writes what tests/xla/test_xla_spmd.py compares:

- `full`: `xla_fsdp` (SPMD FSDPv2, 2 devices) for 6 steps, checkpoints at 3 and 6, then save_model;
- `resumed`: a new run resumed from checkpoint-3 to step 6 (in the same process, so steps that
  replay the full run's graphs find them compiled);
- `wrapped`: the same 6 steps with auto-wrap by class and activation checkpointing (HF's form:
  fsdp + fsdp_config with xla, xla_fsdp_v2, transformer_layer_cls_to_wrap, xla_fsdp_grad_ckpt)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

from kiln import Trainer  # noqa: E402
from kiln.engine.callbacks.base import Callback  # noqa: E402
from tests.xla.spmd_cases import config, model, train_data  # noqa: E402


class AtStep3(Callback):
    """Weights and optimizer state (on the CPU) when step 4 begins: after step 3, or after loading
    checkpoint-3; and how many graphs steps 4 to 6 compiled."""

    def __init__(self):
        self.trainer, self.snapshot, self.compiled = None, None, None

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == 3:
            opt = self.trainer.optimizer.state_dict()
            self.snapshot = {
                **params(self.trainer),
                **{f"optim.{i}.{k}": v.detach().cpu() for i, s in opt["state"].items() for k, v in s.items()},
            }
            self.compiled = compilations()

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 6:
            self.compiled = compilations() - self.compiled


def compilations() -> int:
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def params(trainer):
    return {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}


def main(out: str) -> None:
    results = {}
    seen = AtStep3()
    trainer = Trainer(
        model(),
        config(os.path.join(out, "full"), save_steps=3, save_strategy="steps"),
        train_dataset=train_data(),
        callbacks=[seen],
    )
    seen.trainer = trainer
    trainer.fit()
    results["full_at_3"] = seen.snapshot
    results["full"] = params(trainer)
    first = trainer.model.net[0].weight
    results["sharding"] = torch_xla._XLAC._get_xla_sharding_spec(first)
    results["devices"] = trainer.strategy.num_devices
    trainer.save_model(os.path.join(out, "model"))

    seen = AtStep3()
    resumed = Trainer(
        model(seed=123), config(os.path.join(out, "resumed")), train_dataset=train_data(), callbacks=[seen]
    )
    seen.trainer = resumed
    resumed.fit(resume_from_checkpoint=os.path.join(out, "full", "checkpoint-3"))
    results["resumed"] = params(resumed)
    results["resumed_at_3"] = seen.snapshot
    results["resumed_compiled"] = seen.compiled  # steps 4-6 after the load: 0 if they replay the full run's graphs

    hf = {
        "fsdp": "full_shard auto_wrap",
        "fsdp_config": {
            "xla": True,
            "xla_fsdp_v2": True,
            "xla_fsdp_grad_ckpt": True,
            "transformer_layer_cls_to_wrap": ["Linear"],
        },
    }
    cfg = config(os.path.join(out, "wrapped"), **hf)
    del cfg["strategy"]
    wrapped = Trainer(model(), cfg, train_dataset=train_data())
    wrapped.fit()
    results["wrapped"] = params(wrapped)
    results["wrapped_strategy"] = (wrapped.strategy.name, wrapped.strategy.settings.activation_checkpointing)
    torch.save(results, os.path.join(out, "results.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
