"""Models shared by the benchmarks: an overhead-dominated MLP and a compute-bound small transformer, and a
dataset whose per-sample transform makes the loader the bottleneck; the GPU decoder of bench/compiled.py."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes)
        )

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.cross_entropy(self.net(x), labels)}


class SmallTransformer(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 256, layers: int = 4, seq: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(self.emb(input_ids) + self.pos, mask=self.mask, is_causal=True)
        return {"loss": F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())}


class Augmented(torch.utils.data.Dataset):
    """The tiny MLP's samples behind a per-sample Python transform in `__getitem__` (Gaussian jitter drawn
    from `random`, one value at a time, `passes` times over the row, as hand-written augmentation does): the
    loader, not the model, bounds the step. Its draws come from the process's `random` stream, so they
    differ between loaders (kiln re-seeds each sample in worker processes); the work does not."""

    def __init__(self, n: int = 8192, d_in: int = 32, classes: int = 10, passes: int = 4) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows: list[list[float]] = torch.randn(n, d_in, generator=g).tolist()
        self.labels = list(torch.randint(0, classes, (n,), generator=g).unbind())
        self.passes = passes

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.rows[i]
        for _ in range(self.passes):
            x = [v + random.gauss(0.0, 0.05) for v in x]
        return {"x": torch.tensor(x), "labels": self.labels[i]}


# bench/compiled.py's GPU workload: a nanoGPT-style decoder (pre-norm, fused QKV, causal SDPA, an untied head)
class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Decoder(nn.Module):
    _no_split_modules = ["Block"]  # its repeated block, for FSDP's wrap and regional compile

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.emb(input_ids) + self.pos
        for block in self.blocks:
            h = block(h)
        return {"loss": F.cross_entropy(self.head(self.norm(h)).flatten(0, 1), labels.flatten())}
