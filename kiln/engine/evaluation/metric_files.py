"""HF's metric helpers of the Trainer (`log_metrics`, `save_metrics`, `metrics_format`, which the Trainer's
methods of those names call): the `***** <split> metrics *****` block and the `<split>_results.json` /
`all_results.json` files, written by global rank 0 only."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.engine.evaluation.outputs import to_python

if TYPE_CHECKING:
    from kiln.strategies.base import Strategy


def metrics_format(metrics: Mapping[str, float]) -> dict[str, Any]:
    """Human-readable values (runtimes as h:mm:ss.xx, memory in MB, floats to 4 places)."""
    from kiln.loggers.metrics import metrics_format

    return metrics_format(dict(metrics))


def log_metrics(strategy: Strategy, split: str, metrics: Mapping[str, float]) -> None:
    """Print `***** <split> metrics *****` and aligned `key = value` lines, on global rank 0."""
    if strategy.is_global_zero:
        from kiln.loggers.metrics import format_log_metrics

        print(format_log_metrics(split, dict(metrics)), flush=True)


def save_metrics(
    strategy: Strategy, output_dir: str, split: str, metrics: Mapping[str, float], combined: bool = True
) -> None:
    """Write raw `<split>_results.json` (and merge it into `all_results.json`), on global rank 0."""
    if strategy.is_global_zero:
        write_metrics(output_dir, split, metrics, combined)


def write_metrics(output_dir: str, split: str, metrics: Mapping[str, float], combined: bool = True) -> None:
    """HF's `save_metrics`: raw `<split>_results.json`, merged into `all_results.json` when `combined`."""
    os.makedirs(output_dir, exist_ok=True)
    plain = {k: to_python(v) for k, v in metrics.items()}
    _write_json(os.path.join(output_dir, f"{split}_results.json"), plain)
    if combined:
        path = os.path.join(output_dir, "all_results.json")
        merged: dict[str, Any] = {}
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                merged = json.load(fh)
        merged.update(plain)
        _write_json(path, merged)


def _write_json(path: str, data: Mapping[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(dict(data), fh, indent=4, sort_keys=True)
