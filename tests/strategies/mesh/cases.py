"""The features both presets of the mesh strategy must run alike -- compile, CPU offload, activation
checkpointing, fp16 and tensor parallelism -- as named runs of TinyLM (tests/strategies/fsdp/cases.py:
the same global batch of padded sequences for any mesh, accumulation 2, clipping on every step).
`<preset>_<feature>`, preset `fsdp` or `mp` (model_parallel), is one run; the two presets of one
feature ask for the same mesh, in each preset's own words."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from kiln import Callback  # noqa: E402
from tests.helpers import padded_token_data  # noqa: E402
from tests.strategies.fsdp.cases import TinyLM  # noqa: E402

#: TinyLM's blocks as one TP region each: `up` split by its outputs (tanh works on the split), `down`
#: by its inputs (its outputs summed whole)
PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
PRESETS = {
    "fsdp": {"name": "fsdp", "device": "cpu", "wrap": ["Block"]},
    "mp": {"name": "model_parallel", "device": "cpu", "wrap": ["Block"]},
}
#: the tp axis of size 2 over both processes, as each preset writes it
TP = {"fsdp": {"tp": 2, "tp_plan": PLAN}, "mp": {"mesh": {"tp": 2}, "tp_plan": PLAN}}
COMPILE = {"torch_compile_backend": "aot_eager"}  # AOT autograd's graphs, without inductor's C++ build

#: feature -> (strategy options, config entries, tensor parallel?)
FEATURES: dict[str, tuple[dict[str, Any], dict[str, Any], bool]] = {
    "tp": ({}, {}, True),
    "ac": ({"activation_checkpointing": True}, {}, False),
    "ac_tp": ({"activation_checkpointing": True}, {}, True),
    "offload": ({"offload": True}, {}, False),
    "compile": ({}, COMPILE, False),
    "compile_tp": ({}, COMPILE, True),
    "fp16": ({}, {"fp16": True}, False),
    "fp16_tp": ({}, {"fp16": True}, True),  # rank 0's gradient gets an inf at step INF_STEP (PoisonOnce)
}
#: the step whose optimizer step sees an inf in one element of rank 0's gradient (fp16_tp only)
INF_STEP = 1


def split(name: str) -> tuple[str, str]:
    preset, _, feature = name.partition("_")
    return preset, feature


def config(name: str, root: str, world: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "output_dir": os.path.join(root, name),
        "seed": 3,
        "learning_rate": 0.02,
        "max_steps": 6,
        "gradient_accumulation_steps": 2,
        "max_grad_norm": 0.3,
        "save": {"strategy": "no"},
        "log": {"history": [], "disable_tqdm": True, "steps": 1},
    }
    if name in ("single", "single_fp16"):
        cfg.update(
            {
                "strategy": {"name": "single", "device": "cpu"},
                "per_device_train_batch_size": 4,
                **({"fp16": True} if name == "single_fp16" else {}),
            }
        )
        return cfg
    preset, feature = split(name)
    options, extra, tp = FEATURES[feature]
    cfg["strategy"] = {**PRESETS[preset], **options, **(TP[preset] if tp else {})}
    cfg["per_device_train_batch_size"] = 4 if tp else 4 // world  # one data shard under tp 2
    cfg.update(extra)
    return cfg


class PoisonOnce(Callback):
    """An inf in one element of rank 0's local gradient before step INF_STEP's optimizer step: only rank
    0 can see it, so a scaler whose inf check stayed local would let rank 1 step."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        import torch.distributed as dist

        if state.global_step == INF_STEP and dist.get_rank() == 0:
            grad = self.trainer.model.blocks[0].up.weight.grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")


def run_case(name: str, root: str, world: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from kiln import Trainer

    torch.manual_seed(0)
    trainer = Trainer(TinyLM(), config(name, root, world), train_dataset=padded_token_data(48, 10, 11, seed=1))
    if name == "mp_fp16_tp" or name == "fsdp_fp16_tp":
        trainer.add_callback(PoisonOnce(trainer))
    trainer.fit()
    hist = trainer.state.log_history
    model, precision = trainer.model, trainer.precision
    result = {
        "losses": [h["loss"] for h in hist if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in hist if "grad_norm" in h],
        "strategy": type(trainer.strategy).__name__,
        "data_shards": trainer.strategy.data_shards,
        "precision": type(precision).__name__,
        "skipped": getattr(precision, "skipped_steps", 0),
        "scaler": type(precision.scaler).__name__ if precision.uses_grad_scaler else None,
        **facts(model),
    }
    every: list[Any] = [result["skipped"]] * world
    if world > 1:
        torch.distributed.all_gather_object(every, result["skipped"])
    result["skipped_per_rank"] = every
    state = trainer.strategy.model_state_for_export(model)
    return result, {k: v.detach().float().cpu().clone() for k, v in state.items()}


def facts(model: Any) -> dict[str, Any]:
    """What parity cannot see: which features really acted on the set-up module."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    blocks = list(model.blocks)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    offload = {
        type(u._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
        for u in units
        if u._get_fsdp_state()._fsdp_param_group is not None
    }
    return {
        "fsdp_units": len(units),
        "offload": sorted(offload),
        "tp_split": sum(
            1 for p in model.parameters() if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())
        ),
        "checkpointed": sum(1 for b in blocks if _wraps(b.forward, "checkpoint")),
        "compiled": sum(1 for b in blocks if _compiled(b.forward)),
    }


def _compiled(forward: Any) -> bool:
    """torch.compile's wrapper, found through activation checkpointing's wrapper if there is one."""
    while forward is not None:
        if hasattr(forward, "_torchdynamo_orig_callable"):
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False


def _wraps(forward: Any, word: str) -> bool:
    """Whether activation checkpointing replaced the forward (its wrapper's code calls torch's checkpoint)."""
    code = getattr(forward, "__code__", None)
    return code is not None and word in (*code.co_names, *code.co_freevars)
