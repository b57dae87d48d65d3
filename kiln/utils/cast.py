"""Casting a module's floating-point tensors for a while and putting the originals back bit for bit."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def cast_module_temporarily(module: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Floating parameters and buffers cast to `dtype` inside the block (HF's fp16_full_eval /
    bf16_full_eval), their original tensors restored afterwards. Originals of accelerator tensors wait
    on the CPU, so the device really holds only the half-size copy."""
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    if dtype is not None:
        with torch.no_grad():
            for t in itertools.chain(module.parameters(), module.buffers()):
                if t.is_floating_point() and t.dtype != dtype:
                    saved.append((t, t.data if t.device.type == "cpu" else t.data.to("cpu")))
                    t.data = t.data.to(dtype)
    try:
        yield
    finally:
        for t, original in saved:
            t.data = original.to(t.device)
