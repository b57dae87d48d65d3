"""The runs test_tied_export.py exports: a tiny GPT-2 (its lm_head is its token embedding) trained for
2 steps under each strategy, and a tiny tied Llama under tensor parallelism (GPT-2's Conv1D layers take
no tp plan, and a tied embedding stays whole under tp)."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.helpers import padded_token_data

VOCAB = 32
#: case -> (strategy, model family)
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "single": ({"name": "single", "device": "cpu"}, "gpt2"),
    "ddp": ({"name": "ddp", "device": "cpu"}, "gpt2"),
    "fsdp": ({"name": "fsdp", "device": "cpu"}, "gpt2"),
    "fsdp_full": ({"name": "fsdp", "device": "cpu", "state_dict_type": "full"}, "gpt2"),
    "model_parallel": ({"name": "model_parallel", "device": "cpu"}, "gpt2"),
    "model_parallel_tp": ({"name": "model_parallel", "device": "cpu", "mesh": {"tp": 2}}, "llama"),
    "single_llama": ({"name": "single", "device": "cpu"}, "llama"),
    "deepspeed": ({"name": "deepspeed", "device": "cpu"}, "gpt2"),  # ZeRO-2
    "deepspeed_stage_3": ({"name": "deepspeed_stage_3", "device": "cpu"}, "gpt2"),
}


def model_config(family: str) -> Any:
    if family == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=True,
    )


def build(family: str) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model_config(family))


def train_and_export(name: str, out: str, world: int) -> dict[str, torch.Tensor]:
    """Train case `name`, export it to OUT/<name>; the weights the strategy gathered (rank 0's)."""
    from kiln import Trainer

    strategy, family = CASES[name]
    shards = 1 if "mesh" in strategy else world
    cfg = {
        "output_dir": os.path.join(out, "runs", name),
        "seed": 3,
        "learning_rate": 0.05,
        "max_steps": 2,
        "per_device_train_batch_size": 4 // shards,
        "save": {"strategy": "no"},
        "strategy": strategy,
        "log": {"history": [], "disable_tqdm": True},
    }
    trainer = Trainer(build(family), cfg, train_dataset=padded_token_data(16, 8, VOCAB, seed=1))
    trainer.fit()
    trainer.save_model(os.path.join(out, name))
    state = trainer.strategy.model_state_for_export(trainer.model)
    if strategy["name"].startswith("deepspeed"):
        trainer.strategy.teardown()  # ZeRO-3 leaves its config registered with transformers until then
    return {k: v.detach().float().cpu() for k, v in state.items()}


def logits(model: Any) -> torch.Tensor:
    batch = torch.stack([d["input_ids"] for d in padded_token_data(4, 8, VOCAB, seed=9)])
    model.eval()  # no dropout
    with torch.no_grad():
        return model(input_ids=batch).logits
