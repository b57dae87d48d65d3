"""Small models and datasets shared by the tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln import TrainingModule


class TinyRegressor(TrainingModule):
    """Linear -> LayerNorm -> ReLU -> Linear regression; has biases and norm weights (no-decay group)."""

    def __init__(self, d_in: int = 8, hidden: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def training_step(self, batch):
        return F.mse_loss(self(batch["x"]), batch["y"])

    def validation_step(self, batch):
        pred = self(batch["x"])
        return {"loss": F.mse_loss(pred, batch["y"]), "predictions": pred, "labels": batch["y"]}


class TokenModel(TrainingModule):
    """A token-level loss over padded sequences: items are the non-ignored labels."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def training_step(self, batch):
        logits = self.head(self.emb(batch["input_ids"]))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def regression_data(n: int = 64, d_in: int = 8, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    y = x @ torch.randn(d_in, generator=g) + 0.1 * torch.randn(n, generator=g)
    return [{"x": x[i], "y": y[i]} for i in range(n)]


def padded_token_data(n: int = 64, length: int = 12, vocab: int = 11, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Sequences whose number of real tokens varies a lot (1..length), padded with -100 labels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        real = int(torch.randint(1, length + 1, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g)
        labels = ids.roll(-1).clone()
        labels[real:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def base_config(tmp_path, **overrides) -> dict:
    cfg = {
        "output_dir": str(tmp_path / "out"),
        "log": {"history": [], "disable_tqdm": True, "steps": 1000},
        "save": {"strategy": "no"},
        "strategy": {"device": "cpu"},
    }
    cfg.update(overrides)
    return cfg


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train_step_of(trainer: Any) -> Any:
    """The fit loop's TrainStep for `trainer` (its loss weights, outside a fit)."""
    from kiln.engine.loop.step import TrainStep

    return TrainStep(
        trainer.run,
        trainer.strategy,
        trainer.run.facts,
        trainer.config,
        trainer.training_step,
        trainer.current_learning_rate,
        wants_num_items=trainer.wants_num_items,
    )


def momenta(trainer: Any) -> dict[str, torch.Tensor]:
    """Each parameter's SGD momentum buffer as this rank holds it (a DTensor's local piece), by name: the
    optimizer state a resume must bring back."""
    state = trainer.optimizer.state
    buffers = {name: state[p]["momentum_buffer"] for name, p in trainer.model.named_parameters() if p in state}
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in buffers.items()}


@contextmanager
def dcp_writer_threads() -> Iterator[list[str]]:
    """The names of the threads that write torch.distributed.checkpoint's shard files inside the block
    (DCP's own executor thread for `save.async`, MainThread for a synchronous save)."""
    from torch.distributed.checkpoint import filesystem

    writers: list[str] = []
    write_data = filesystem._FileSystemWriter.write_data

    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        writers.append(threading.current_thread().name)
        return write_data(self, *args, **kwargs)

    filesystem._FileSystemWriter.write_data = recorded  # type: ignore[method-assign]
    try:
        yield writers
    finally:
        filesystem._FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
