"""Three small models `kiln estimate` is checked on (task.model / task.data by import path): an MLP
TrainingModule whose weights dominate, and tiny GPT-2 and Llama models whose activations do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln import TrainingModule

VOCAB, LENGTH = 128, 64


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class MLP(TrainingModule):
    _no_split_modules = ["Block"]

    def __init__(self, width: int = 256, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def training_step(self, batch):  # type: ignore[no-untyped-def]
        return F.mse_loss(self.head(self.blocks(batch["x"])).squeeze(-1), batch["y"])


def mlp() -> nn.Module:
    return MLP()


def gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=LENGTH,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


def vectors(n: int = 16, width: int = 256) -> dict:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, width, generator=g), torch.randn(n, generator=g)
    return {"train_dataset": [{"x": x[i], "y": y[i]} for i in range(n)]}


def tokens(n: int = 16) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    return {"train_dataset": [{"input_ids": ids[i], "labels": ids[i]} for i in range(n)]}


def no_data() -> dict:
    return {"train_dataset": None}
