"""A small GPT-style character language model written as a kiln `TrainingModule`.

Pure torch, readable on a couple of screens: token + position embeddings, pre-norm blocks of causal
self-attention (`F.scaled_dot_product_attention(is_causal=True)`) and an MLP, a final norm and a head
tied to the token embedding. The steps follow the kiln contract: `training_step` returns the mean
cross-entropy over every target character and `num_items` counts those characters, so gradient
accumulation normalises exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.engine.model.module import TrainingModule

IGNORE_INDEX = -100


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head}).")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class CharGPT(TrainingModule):
    """Character-level GPT.

    `vocab` (optional) is the list of characters by id, as built by `examples.char_lm.data`; with it,
    `generate` accepts and returns text, without it only token ids. Id 0 is the unknown character.
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        tie_weights: bool = True,
        vocab: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if vocab is not None and len(vocab) != vocab_size:
            raise ValueError(f"vocab has {len(vocab)} characters but vocab_size is {vocab_size}.")
        self.vocab = list(vocab) if vocab is not None else None
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections so the residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch, time, vocab] for every position."""
        t = input_ids.shape[1]
        if t > self.block_size:
            raise ValueError(f"Sequence length {t} exceeds block_size {self.block_size}.")
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    # -- the kiln contract -------------------------------------------------------------------
    def _loss(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
        return loss, logits

    def training_step(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over every target character of the batch."""
        return self._loss(batch)[0]

    def validation_step(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loss plus argmax predictions (not the [B, T, V] logits: they would dwarf the eval set)."""
        loss, logits = self._loss(batch)
        return {"loss": loss, "predictions": logits.argmax(dim=-1), "labels": batch["labels"]}

    def predict_step(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.validation_step(batch)

    def num_items(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Target characters the loss averages over."""
        return batch["labels"].ne(IGNORE_INDEX).sum()

    # -- sampling ------------------------------------------------------------------------------
    def encode(self, text: str) -> torch.Tensor:
        if self.vocab is None:
            raise ValueError("This CharGPT was built without `vocab`; pass token ids instead of text.")
        stoi = {ch: i for i, ch in enumerate(self.vocab)}
        return torch.tensor([stoi.get(ch, 0) for ch in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        if self.vocab is None:
            raise ValueError("This CharGPT was built without `vocab`; it cannot turn ids into text.")
        return "".join(self.vocab[i] for i in torch.as_tensor(ids).tolist())

    @torch.no_grad()
    def generate(
        self,
        prompt: str | torch.Tensor,
        max_new_tokens: int = 200,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Any:
        """Sample `max_new_tokens` characters after `prompt`.

        Text in, text out (prompt + continuation) when the model has a vocab; a 1-D or [batch, time]
        id tensor in, an id tensor of the prompt plus `max_new_tokens` out. `temperature` 0 is greedy.
        """
        as_text = isinstance(prompt, str)
        ids = self.encode(prompt) if as_text else torch.as_tensor(prompt)
        squeeze = ids.dim() == 1
        device = next(self.parameters()).device
        ids = (ids.unsqueeze(0) if squeeze else ids).to(device)
        if ids.shape[1] == 0:
            raise ValueError("generate() needs a non-empty prompt.")
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                logits = self(ids[:, -self.block_size :])[:, -1, :].float()
                if temperature <= 0:
                    nxt = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None and top_k < logits.shape[-1]:
                        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
                ids = torch.cat([ids, nxt], dim=1)
        finally:
            self.train(was_training)
        out = ids[0] if squeeze else ids
        return self.decode(out.cpu()) if as_text else out
