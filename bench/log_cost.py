"""What one log event costs on the training thread, per logger, and what a progress update costs.

    python bench/log_cost.py [--events 200] [--loggers csv jsonl tensorboard mlflow wandb]

Times the calls themselves (no training): `Logger.log_metrics` called directly (what the training
thread paid before the background writer), `LoggerCallback.on_log` (what it pays now: building the
record and queueing it), and ProgressCallback's per-step `on_step_end` and per-log `on_log`, for a
terminal bar and for a log file. Prints microseconds per call (median of the calls)."""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOGS = {"loss": 2.3, "grad_norm": 1.1, "learning_rate": 1e-4, "epoch": 0.5, "samples_per_second": 1000.0}


def per_call(fn: Callable[[int], Any], n: int) -> float:
    times = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def logger_costs(name: str, events: int) -> tuple[float, float]:
    """Microseconds per call of `log_metrics` on the caller's thread, and of `LoggerCallback.on_log`."""
    from kiln.config import load_config
    from kiln.engine.callbacks.loggers import LoggerCallback
    from kiln.engine.callbacks.state import TrainerControl, TrainerState
    from kiln.loggers.build import build_loggers

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            {
                "output_dir": out,
                "report_to": [name] if name not in ("csv", "jsonl") else [],
                "log": {"history": [name] if name in ("csv", "jsonl") else []},
            }
        )
        [logger] = build_loggers(cfg)
        logger.log_hyperparams({})
        direct = per_call(lambda i: logger.log_metrics(LOGS, i + 1), events)
        logger.finalize("success")
    with tempfile.TemporaryDirectory() as out:
        cfg.output_dir = out
        callback = LoggerCallback(cfg, build_loggers(cfg))
        state, control = TrainerState(max_steps=10**6), TrainerControl()
        callback.on_train_begin(cfg, state, control)

        def on_log(i: int) -> None:
            state.global_step = i + 1
            callback.on_log(cfg, state, control, logs=dict(LOGS))

        queued = per_call(on_log, events)
        callback.on_train_end(cfg, state, control)
    return direct, queued


def progress_costs(tty: bool, events: int) -> tuple[float, float]:
    """Microseconds per `ProgressCallback.on_step_end` and per `on_log`, for a terminal bar or a log file."""
    from kiln.engine.callbacks.progress import ProgressCallback
    from kiln.engine.callbacks.state import TrainerControl, TrainerState

    stream = io.StringIO()
    progress = ProgressCallback(file=stream, interactive=tty)
    state, control = TrainerState(max_steps=10**6, is_world_process_zero=True), TrainerControl()
    progress.on_train_begin(None, state, control)  # type: ignore[arg-type]

    def step(i: int) -> None:
        state.global_step = i + 1
        progress.on_step_end(None, state, control)  # type: ignore[arg-type]

    per_step = per_call(step, events * 50)
    per_log = per_call(lambda i: progress.on_log(None, state, control, logs=dict(LOGS)), events)  # type: ignore[arg-type]
    progress.on_train_end(None, state, control)  # type: ignore[arg-type]
    return per_step, per_log


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--loggers", nargs="*", default=["csv", "jsonl", "tensorboard"])
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")

    print("| what | µs per call (median) |\n|---|---|")
    for name in args.loggers:
        direct, queued = logger_costs(name, args.events)
        print(f"| {name}: log_metrics on the caller's thread | {direct:.1f} |")
        print(f"| {name}: LoggerCallback.on_log (queued to the writer) | {queued:.1f} |")
    for tty in (True, False):
        per_step, per_log = progress_costs(tty, args.events)
        kind = "terminal bar" if tty else "log file"
        print(f"| progress ({kind}): on_step_end | {per_step:.2f} |")
        print(f"| progress ({kind}): on_log | {per_log:.1f} |")


if __name__ == "__main__":
    main()
