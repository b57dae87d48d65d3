"""Shared pieces for the logger tests: a config in a temporary output_dir, a known sequence of log
calls, and a driver that plays it through LoggerCallback the way the loop does."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from kiln.config import load_config
from kiln.engine.callbacks.loggers import LoggerCallback
from kiln.engine.callbacks.state import TrainerControl, TrainerState
from kiln.loggers.writer import flush_writes

#: (step, logs) in the order the loop would log them: train windows, an eval, the final summary
SEQUENCE: list[tuple[int, dict[str, float]]] = [
    (1, {"loss": 2.5, "grad_norm": 1.25, "learning_rate": 1e-3, "epoch": 0.125}),
    (2, {"loss": 2.0, "grad_norm": 1.0, "learning_rate": 8e-4, "epoch": 0.25}),
    (2, {"eval_loss": 2.25, "eval_accuracy": 0.5, "epoch": 0.25}),
    (4, {"loss": 1.5, "grad_norm": 0.75, "learning_rate": 4e-4, "epoch": 0.5}),
    (4, {"eval_loss": 1.75, "eval_accuracy": 0.625, "epoch": 0.5}),
    (6, {"loss": 1.0, "grad_norm": 0.5, "learning_rate": 0.0, "epoch": 0.75}),
    (6, {"train_runtime": 1.5, "train_samples_per_second": 32.0, "train_loss": 1.75, "epoch": 0.75}),
]


def make_config(tmp_path, **overrides: Any):
    raw = {"output_dir": str(tmp_path / "out"), "run_name": "unit-run", "log": {"history": []}}
    for key, value in overrides.items():
        if key == "log":
            raw["log"].update(value)
        else:
            raw[key] = value
    return load_config(raw)


def drive(
    callback: LoggerCallback,
    config,
    sequence: Iterable[tuple[int, dict[str, float]]] = SEQUENCE,
    start_step: int = 0,
    end: bool = True,
    state: TrainerState | None = None,
) -> TrainerState:
    """on_train_begin at `start_step`, on_log per entry (state.global_step = its step), on_train_end."""
    state = state or TrainerState(max_steps=6)
    state.global_step = start_step
    control = TrainerControl()
    callback.on_train_begin(config, state, control)
    for step, logs in sequence:
        state.global_step = step
        callback.on_log(config, state, control, logs=dict(logs))
    if end:
        callback.on_train_end(config, state, control)
    else:  # a job that stops here: what it logged has reached the files (the writer runs in the background)
        flush_writes()
    return state


def expected_points(name: str, sequence=SEQUENCE) -> list[tuple[int, float]]:
    return [(step, logs[name]) for step, logs in sequence if name in logs]


@pytest.fixture
def config(tmp_path):
    return make_config(tmp_path)
