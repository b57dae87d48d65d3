"""What `fit` prints when it starts (`log.model_summary`): one line saying how big the model is, in which
dtype its parameters train, and which strategy, precision, device and process count run it; and on one
process, below it, Lightning's ModelSummary table: one row per module down to `log.model_summary_depth`
(name, type, parameters, trainable parameters, size), then the totals."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _numel(param: Any) -> int:
    """Elements of the full parameter: ZeRO-3 leaves an empty tensor in the module and keeps the full
    size in `ds_numel` (without this a partitioned model reports "0 parameters")."""
    return int(getattr(param, "ds_numel", 0) or param.numel())


def _dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def model_summary(model: nn.Module, strategy: Any, precision: Any) -> str:
    """e.g. `model MLP: 85.0K parameters (85.0K trainable, float32); strategy ddp on cpu, 2 processes;
    precision bf16 (float32 weights, bfloat16 compute)`. Parameter dtypes are the ones training uses
    (a true-half plugin casts the model when training starts)."""
    params = list(model.parameters())
    total = sum(_numel(p) for p in params)
    trainable = sum(_numel(p) for p in params if p.requires_grad)
    weights = precision.param_dtype
    if weights is None:
        counts = Counter(p.dtype for p in params)
        weights = counts.most_common(1)[0][0] if counts else None
    compute = precision.compute_dtype or weights
    procs = strategy.world_size
    return (
        f"model {type(model).__name__}: {_count(total)} parameters ({_count(trainable)} trainable, {_dtype(weights)}); "
        f"strategy {strategy.name} on {strategy.root_device.type}, {procs} process{'es' if procs != 1 else ''}; "
        f"precision {precision.name} ({_dtype(weights)} weights, {_dtype(compute)} compute)"
    )


def _size(n_bytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n_bytes >= size:
            return f"{n_bytes / size:.1f} {unit}"
    return f"{int(n_bytes)} B"


def _tally(params: list[Any], dtype: torch.dtype | None) -> tuple[int, int, float]:
    """(parameters, trainable, bytes) of `params`; bytes in `dtype` when training casts to it."""
    total = trainable = 0
    size = 0.0
    for p in params:
        n = _numel(p)
        total += n
        trainable += n if p.requires_grad else 0
        size += n * (dtype.itemsize if dtype is not None else p.element_size())
    return total, trainable, size


def model_table(model: nn.Module, precision: Any, max_depth: int = 1) -> list[str]:
    """Lightning's ModelSummary: a row per module down to `max_depth` levels below the model (-1: every
    module), then the totals. A parameter shared by several modules counts once in each of their rows and
    once in the totals."""
    dtype = precision.param_dtype
    rows: list[tuple[str, ...]] = []
    for name, module in model.named_modules():
        depth = name.count(".") + 1
        if not name or (max_depth >= 0 and depth > max_depth):
            continue
        total, trainable, size = _tally(list(module.parameters()), dtype)
        rows.append((str(len(rows)), name, type(module).__name__, _count(total), _count(trainable), _size(size)))
    header = ("", "Name", "Type", "Params", "Trainable", "Size")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    rule = "-" * max(len(line) for line in lines)
    total, trainable, size = _tally(list(model.parameters()), dtype)
    totals = [
        (_count(trainable), "Trainable params"),
        (_count(total - trainable), "Non-trainable params"),
        (_count(total), "Total params"),
        (_size(size), "Total estimated model params size"),
    ]
    return [lines[0], rule, *lines[1:], rule, *(f"{value:<10}{what}" for value, what in totals)]


def print_start_summary(model: nn.Module, strategy: Any, precision: Any, config: Any) -> None:
    """`start_summary`, printed by the main process when `fit` starts (quiet runs, `log.level` error or
    critical, stay quiet)."""
    if strategy.is_global_zero and config.log.level not in ("error", "critical"):
        summary = start_summary(model, strategy, precision, config.log.model_summary, config.log.model_summary_depth)
        if summary is not None:
            print(summary, flush=True)


def start_summary(model: nn.Module, strategy: Any, precision: Any, mode: str, max_depth: int) -> str | None:
    """What `fit` prints on the main process when it starts (`log.model_summary`): `line`, `table` (the line,
    then `model_table`), `off`, or `auto`: the table on one process, the line alone with several (each
    of their start-ups would otherwise scroll a table past)."""
    if mode == "off":
        return None
    line = f"kiln: {model_summary(model, strategy, precision)}"
    if mode == "line" or (mode == "auto" and strategy.world_size > 1):
        return line
    return "\n".join([line, *model_table(model, precision, max_depth)])
