"""Shared pieces for the checkpoint tests: a small model with dropout, datasets, and a way to
"crash" a run right after a chosen checkpoint and resume it in a fresh Trainer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset

from kiln.engine.callbacks.base import Callback
from kiln.engine.model.module import TrainingModule
from kiln.engine.trainer import Trainer

#: log keys that are pure numerics (timings such as samples_per_second differ between any two runs)
NUMERIC = ("loss", "grad_norm", "learning_rate", "epoch", "eval_loss", "train_loss", "step")


class Net(TrainingModule):
    """Two-layer regressor with dropout, so a resume must restore the RNG to match."""

    def __init__(self, dropout: float = 0.3, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.inp(x)))).squeeze(-1)

    def training_step(self, batch: Any) -> torch.Tensor:
        return ((self(batch["x"]) - batch["y"]) ** 2).mean()

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        pred = self(batch["x"])
        return {"loss": ((pred - batch["y"]) ** 2).mean(), "predictions": pred, "labels": batch["y"]}


class Scripted:
    """compute_metrics that returns the next value of a fixed sequence as `score`, so the best
    checkpoint is known in advance."""

    def __init__(self, values: list[float], name: str = "score") -> None:
        self.values, self.name, self.calls = list(values), name, 0

    def __call__(self, prediction: Any) -> dict[str, float]:
        value = self.values[self.calls]
        self.calls += 1
        return {self.name: value}


def make_model(seed: int = 0, **kw: Any) -> Net:
    torch.manual_seed(seed)
    return Net(**kw)


def regression_data(n: int = 40, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x.sum(-1) + 0.1 * torch.randn(n, generator=g)
    return [{"x": x[i], "y": y[i]} for i in range(n)]


class Stream(IterableDataset):
    """A deterministic stream; with `stateful`, it saves and restores its position like HF datasets."""

    def __init__(self, n: int = 30, seed: int = 2) -> None:
        self.items = regression_data(n, seed)
        self.pos = 0
        self._resume: int | None = None

    def __iter__(self):
        self.pos, self._resume = (self._resume or 0), None
        while self.pos < len(self.items):
            i = self.pos
            self.pos += 1
            yield self.items[i]


class StatefulStream(Stream):
    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = state["pos"]


class Crash(RuntimeError):
    """Stands in for a SIGKILL right after a checkpoint was written."""


class CrashAfterSave(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            raise Crash(f"simulated crash after saving step {self.step}")


def config(out: str, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "output_dir": out,
        "max_steps": 20,
        "per_device_train_batch_size": 4,
        "learning_rate": 0.05,
        "logging_steps": 3,
        "save_steps": 5,
        "seed": 7,
        "report_to": "none",
        "disable_tqdm": True,
        "log": {"history": []},
    }
    cfg.update(overrides)
    return cfg


def numeric_history(trainer: Trainer) -> list[dict[str, Any]]:
    return [{k: v for k, v in entry.items() if k in NUMERIC} for entry in trainer.state.log_history]


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def train(
    out: str,
    cfg: dict[str, Any],
    data: Callable[[], Any] = regression_data,
    eval_data: Callable[[], Any] | None = None,
    model_seed: int = 0,
    crash_at: int | None = None,
    resume: Any = None,
    model_kw: dict | None = None,
    **trainer_kw: Any,
) -> Trainer:
    callbacks = list(trainer_kw.pop("callbacks", None) or []) + ([CrashAfterSave(crash_at)] if crash_at else [])
    trainer = Trainer(
        make_model(model_seed, **(model_kw or {})),
        config(out, **cfg),
        train_dataset=data(),
        eval_dataset=eval_data() if eval_data else None,
        callbacks=callbacks,
        **trainer_kw,
    )
    trainer.fit(resume_from_checkpoint=resume)
    return trainer


def folders(out: str) -> set[str]:
    """Checkpoint folder names in `out` (hidden debris included, to catch leftovers)."""
    import os

    return {n for n in os.listdir(out) if "checkpoint" in n} if os.path.isdir(out) else set()


def straight_vs_resumed(
    tmp_path: Any,
    cfg: dict[str, Any],
    crash_at: int,
    data: Callable[[], Any],
    eval_data: Callable[[], Any] | None = None,
    model_kw: dict | None = None,
) -> tuple[Trainer, Trainer]:
    """Train uninterrupted; separately train, crash right after saving `crash_at`, and resume in a fresh
    Trainer with a fresh (differently initialised) model. Returns both finished trainers."""
    import pytest

    straight = train(str(tmp_path / "straight"), cfg, data, eval_data, model_kw=model_kw)
    out = str(tmp_path / "crashed")
    with pytest.raises(Crash):
        train(out, cfg, data, eval_data, crash_at=crash_at, model_kw=model_kw)
    resumed = train(out, cfg, data, eval_data, model_seed=1234, resume=True, model_kw=model_kw)
    return straight, resumed
