"""Model, data and named runs shared by the FSDP workers (every rank) and the tests (the parent).
A run is `run_case(name, root, world)`: the same global batch for any number of processes."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from kiln import TrainingModule  # noqa: E402
from tests.helpers import padded_token_data  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TinyLM(TrainingModule):
    """Two blocks between an embedding and a head; token-level loss over padded sequences, so ranks
    and micro-batches hold different numbers of tokens."""

    _no_split_modules = ["Block"]

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.head = nn.Linear(dim, vocab)

    def logits(self, batch: dict) -> torch.Tensor:
        h = self.emb(batch["input_ids"])
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch: dict) -> torch.Tensor:
        return F.cross_entropy(self.logits(batch).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def validation_step(self, batch: dict) -> dict:
        logits = self.logits(batch)
        return {
            "loss": F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100),
            "logits": logits,
            "labels": batch["labels"],
        }


FSDP = {"name": "fsdp", "device": "cpu", "wrap": ["Block"]}

#: name -> config entries beside the common ones
CASES: dict[str, dict[str, Any]] = {
    "single": {"strategy": {"name": "single", "device": "cpu"}},
    "ddp": {"strategy": {"name": "ddp", "device": "cpu"}},
    "full_shard": {"strategy": FSDP},
    "shard_grad_op": {"strategy": {**FSDP, "sharding": "shard_grad_op"}},
    "no_shard": {"strategy": {**FSDP, "sharding": "no_shard"}},
    "hybrid_shard": {"strategy": {**FSDP, "sharding": "hybrid_shard"}},  # (1, 2) mesh: one node
    "hybrid_shard_1": {"strategy": {**FSDP, "sharding": "hybrid_shard", "shard_size": 1}},  # (2, 1): replicate
    "hybrid_shard_zero2": {"strategy": {**FSDP, "sharding": "hybrid_shard_zero2"}},
    "offload": {"strategy": {**FSDP, "offload": True}},
    "min_num_params": {"strategy": {"name": "fsdp", "device": "cpu", "min_num_params": 100}},
    "default_wrap": {"strategy": {"name": "fsdp", "device": "cpu"}},  # _no_split_modules
    # the config's section (the strategy's own `activation_checkpointing: true` is its alias: tests/strategies/mesh)
    "activation_checkpointing": {"strategy": FSDP, "activation_checkpointing": {"mode": "selective"}},
    "ddp_activation_checkpointing": {
        "strategy": {"name": "ddp", "device": "cpu"},
        "activation_checkpointing": {"mode": "full"},
    },
    "forward_prefetch": {"strategy": {**FSDP, "forward_prefetch": True, "sync_module_states": True}},
    "bf16": {"strategy": FSDP, "bf16": True},
    # HF arguments: the flag string and fsdp_config with prefixed keys
    "hf": {
        "fsdp": "full_shard auto_wrap",
        "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": ["Block"], "use_orig_params": True},
        "strategy": {"device": "cpu"},
    },
}


def config(name: str, root: str, world: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "output_dir": os.path.join(root, name),
        "seed": 3,
        "learning_rate": 0.02,
        "max_steps": 6,
        "per_device_train_batch_size": 4 // world,
        "gradient_accumulation_steps": 2,
        "max_grad_norm": 0.3,  # small enough that every step clips
        "save": {"strategy": "no"},
        "log": {"history": [], "disable_tqdm": True, "steps": 1},
    }
    cfg.update(CASES[name])
    cfg.update(extra)
    return cfg


def trainer_for(name: str, root: str, world: int, model: Any = None, **extra: Any) -> Any:
    from kiln import Trainer

    torch.manual_seed(0)
    return Trainer(
        model if model is not None else TinyLM(),
        config(name, root, world, **extra),
        train_dataset=padded_token_data(48, 10, 11, seed=1),
        eval_dataset=padded_token_data(6, 10, 11, seed=2),
    )


def full_weights(trainer: Any) -> dict[str, torch.Tensor]:
    state = trainer.strategy.model_state_for_export(trainer.model)
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def run_case(name: str, root: str, world: int, **extra: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    trainer = trainer_for(name, root, world, **extra)
    trainer.fit()
    hist = trainer.state.log_history
    result = {
        "losses": [h["loss"] for h in hist if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in hist if "grad_norm" in h],
        "precision": type(trainer.precision).__name__,
        "strategy": type(trainer.strategy).__name__,
        "checkpointed": sum(bool(getattr(m, "_kiln_checkpointed", False)) for m in trainer.model.modules()),
    }
    return result, full_weights(trainer)
