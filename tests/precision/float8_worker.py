"""The float8 cases that need several processes, all in one world (torchrun --nproc_per_node=N float8_worker.py
OUT CASE [...]): on 2, kiln's fp8 under model_parallel tp 2 and under fsdp, each beside the same training by hand
with torchao (float8_models.py), and kiln's mxfp8 under ddp; on 4, kiln's fp8 under tp 2 x dp_shard 2 beside its
hand-written torchao + FSDP2 twin; rank 0 writes their weights and what the tp layers were given
(case_jobs.run_cases)."""

import os
import sys
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from kiln import Trainer  # noqa: E402
from tests.helpers import base_config, regression_data  # noqa: E402
from tests.precision import float8_models as models  # noqa: E402
from tests.strategies.case_jobs import run_cases  # noqa: E402

STEPS, BATCH, LR, SEED = 4, 8, 0.05, 3
TP = {"name": "model_parallel", "device": "cpu", "mesh": {"tp": 2}, "tp_plan": {"net.0": "colwise", "net.2": "rowwise"}}
TP_DP = {**TP, "mesh": {"tp": 2, "dp_shard": 2}}


def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def layer_inputs(model: torch.nn.Module) -> dict[str, str]:
    """What the tp layers' forward gets once the split's own hooks ran: torchao's float8 styles hand it an
    input already cast to float8 (a Float8TrainingTensor inside the DTensor), torch's a bf16 one."""
    seen: dict[str, str] = {}
    layers = {"net.0": model.net[0], "net.2": model.net[2]}

    def record(name: str):
        def hook(_: torch.nn.Module, args: tuple) -> None:
            seen[name] = type(getattr(args[0], "_local_tensor", args[0])).__name__

        return hook

    hooks = [layer.register_forward_pre_hook(record(name)) for name, layer in layers.items()]
    x = regression_data(8, d_in=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.stack([d["x"] for d in x]), torch.stack([d["y"] for d in x]))
    for hook in hooks:
        hook.remove()
    return seen


def mxfp8_ddp(root: str) -> dict[str, torch.Tensor]:
    """kiln's mxfp8 under ddp: 32 samples a rank (MXFP8 blocks the weight gradient by 32 tokens)."""
    cfg = base_config(
        Path(root) / "ddp2_mxfp8",
        precision={"name": "mxfp8", "mxfp8": {"emulate": True}},
        strategy={"name": "ddp", "device": "cpu"},
        optim={"name": "sgd"},
        max_grad_norm=0.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        per_device_train_batch_size=32,
        max_steps=2,
        seed=SEED,
    )
    torch.manual_seed(0)
    model = models.MXRegressor()
    Trainer(model, cfg, train_dataset=regression_data(128, d_in=32)).fit()
    return full(model)


def run_case(name: str, root: str, world: int) -> tuple[dict, dict[str, torch.Tensor]]:
    if name == "ddp2_mxfp8":
        return {}, mxfp8_ddp(root)
    data = regression_data(64, d_in=16)
    kind, _, recipe = name.partition("_")
    if recipe.endswith("hand"):
        recipe = recipe.removesuffix("hand").rstrip("_") or "tensorwise"
        hand = {
            "tp2": models.hand_float8_tp_sgd,
            "fsdp2": models.hand_float8_fsdp_sgd,
            "tp2dp2": models.hand_float8_tp_fsdp_sgd,
        }[kind]
        extra = {"recipe": recipe} if kind.startswith("tp2") else {}
        model = hand(data, steps=STEPS, batch=BATCH, lr=LR, seed=SEED, **extra)
        return {}, full(model)
    cfg = base_config(
        Path(root) / name,
        precision={"name": "fp8", "fp8": {"emulate": True, "recipe": recipe or "tensorwise"}},
        strategy={"tp2": TP, "tp2dp2": TP_DP}.get(kind, {"name": "fsdp", "device": "cpu"}),
        optim={"name": "sgd"},
        max_grad_norm=0.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        seed=SEED,
    )
    torch.manual_seed(0)
    model = models.Float8LossNet()
    trainer = Trainer(model, cfg, train_dataset=data)
    trainer.fit()
    results = {"inputs": layer_inputs(model)} if kind.startswith("tp2") else {}
    if kind == "tp2dp2":  # what FSDP keeps of each split weight: a float8 all-gather's wrapper, or a plain shard
        results["shards"] = sorted({type(p.to_local()).__name__ for p in model.parameters()})
    return results, full(model)


if __name__ == "__main__":
    run_cases(lambda entry, root, world: run_case(entry, root, world), sys.argv[1], sys.argv[2:])
