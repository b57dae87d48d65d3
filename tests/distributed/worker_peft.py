"""A LoRA GPT-2 (tiny, built from a config) trained by kiln under DDP and FSDP on every rank, then
resumed from its step-2 adapter checkpoint in a fresh model. Rank 0 writes OUT/tensors.safetensors
(`<case>/<straight|resumed>/<name>`: every weight of the PeftModel, gathered) and OUT/results.json
(the files of checkpoint-2). The model, data and config are shared with the one-process reference
run of tests/engine/test_peft_distributed.py (`run_case(..., world=1)`).
Usage: torchrun --nproc_per_node=2 worker_peft.py OUT CASE [CASE ...]"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from tests.helpers import padded_token_data  # noqa: E402

STRATEGIES = {
    "single": {"name": "single", "device": "cpu"},
    "ddp": {"name": "ddp", "device": "cpu"},
    "fsdp": {"name": "fsdp", "device": "cpu"},  # wraps GPT2Block (the base model's _no_split_modules)
    "fsdp_full": {"name": "fsdp", "device": "cpu", "state_dict_type": "full"},
}


def base_model(seed: int = 0) -> torch.nn.Module:
    """The 'pretrained' model: the same weights wherever it is built with the same seed."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=11,
        n_positions=10,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def lora_model(seed: int = 0, lora_seed: int = 1, **lora: Any) -> torch.nn.Module:
    """`base_model(seed)` with a LoRA adapter on every attention block, initialised from `lora_seed`
    (lora_B random too, so every adapter tensor takes part from the first step)."""
    from peft import LoraConfig, get_peft_model

    model = base_model(seed)
    torch.manual_seed(lora_seed)
    settings = {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["c_attn"],
        "lora_dropout": 0.0,
        "fan_in_fan_out": True,
        "init_lora_weights": "gaussian",
        **lora,
    }
    peft = get_peft_model(model, LoraConfig(**settings))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return peft


def data() -> list[dict[str, torch.Tensor]]:
    return padded_token_data(32, 10, 11, seed=1)


def config(case: str, root: str, world: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "output_dir": os.path.join(root, case),
        "seed": 3,
        "learning_rate": 0.05,
        "max_steps": 4,
        "per_device_train_batch_size": 4 // world,
        "gradient_accumulation_steps": 2,
        "max_grad_norm": 0.5,
        "save": {"strategy": "steps", "steps": 2},
        "log": {"history": [], "disable_tqdm": True, "steps": 1},
        "strategy": STRATEGIES[case],
    }
    cfg.update(extra)
    return cfg


def full_weights(trainer: Any) -> dict[str, torch.Tensor]:
    state = trainer.strategy.model_state_for_export(trainer.model)
    return {k: v.detach().float().cpu().clone().contiguous() for k, v in state.items()}


def _layout(model: torch.nn.Module) -> dict[str, Any]:
    """Whether the parameters are DTensor shards, and the FSDP units (GPT2Blocks) holding frozen and
    trainable parameters together."""
    from torch.distributed.tensor import DTensor

    mixed = [
        name
        for name, m in model.named_modules()
        if type(m).__name__.startswith("FSDP") and name and len({p.requires_grad for p in m.parameters()}) == 2
    ]
    return {"sharded": any(isinstance(p, DTensor) for p in model.parameters()), "mixed_units": mixed}


def run_case(case: str, root: str, world: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Train 4 steps (checkpoints at 2 and 4), then resume a fresh model (other LoRA init) from checkpoint-2."""
    from kiln import Trainer

    straight = Trainer(lora_model(), config(case, root, world), train_dataset=data())
    straight.fit()
    tensors = {f"straight/{k}": v for k, v in full_weights(straight).items()}
    ckpt = os.path.join(root, case, "checkpoint-2")
    with open(os.path.join(ckpt, "COMPLETE")) as fh:
        fmt = json.load(fh)["format"]
    result = {
        "files": sorted(os.listdir(ckpt)),
        "losses": [h["loss"] for h in straight.state.log_history if "loss" in h],
        "strategy": type(straight.strategy).__name__,
        "format": fmt,
        **_layout(straight.model),
    }
    resumed = Trainer(lora_model(lora_seed=7), config(case, os.path.join(root, "resumed"), world), train_dataset=data())
    resumed.fit(resume_from_checkpoint=ckpt)
    tensors.update({f"resumed/{k}": v for k, v in full_weights(resumed).items()})
    result["resumed_losses"] = [h["loss"] for h in resumed.state.log_history if "loss" in h]
    return result, tensors


if __name__ == "__main__":
    from safetensors.torch import save_file

    out, cases = sys.argv[1], sys.argv[2:]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results, tensors = {}, {}
    for case in cases:
        print("CASE", case, file=sys.stderr, flush=True)
        results[case], weights = run_case(case, os.path.join(out, "runs"), world)
        tensors.update({f"{case}/{k}": v for k, v in weights.items()})
    if int(os.environ.get("RANK", "0")) == 0:
        save_file(tensors, os.path.join(out, "tensors.safetensors"))
        with open(os.path.join(out, "results.json"), "w") as fh:
            json.dump(results, fh)

    import torch.distributed as dist  # leave the process group before interpreter shutdown

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
