"""The one line printed when training starts (like Lightning's model summary): how big the model is,
in which dtype its parameters train, and which strategy, precision, device and process count run it."""

from __future__ import annotations

from collections import Counter
from typing import Any

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
    return (f"model {type(model).__name__}: {_count(total)} parameters ({_count(trainable)} trainable, {_dtype(weights)}); "
            f"strategy {strategy.name} on {strategy.root_device.type}, {procs} process{'es' if procs != 1 else ''}; "
            f"precision {precision.name} ({_dtype(weights)} weights, {_dtype(compute)} compute)")
