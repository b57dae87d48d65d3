"""Small helpers for nested batches (dicts, lists, tuples, dataclass-like mappings of tensors)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a nested batch to `device` (non-blocking when it can be).

    A tensor already there is returned as is: `.to()` would return it too, but only after a trip through
    the dispatcher that costs microseconds per tensor per step, which the hot path of a small model feels."""
    if type(batch) is dict:  # the usual batch, a dict of tensors: no recursion for the tensors themselves
        for v in batch.values():
            if type(v) is not torch.Tensor or v.device != device:
                return {
                    k: v if type(v) is torch.Tensor and v.device == device else move_to_device(v, device)
                    for k, v in batch.items()
                }
        return batch  # everything is there already (the CPU, or a loader that placed it): no new dict
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        # type(batch) is a concrete mapping (dict, BatchEncoding, ...) built from a dict; mypy sees abstract Mapping
        return type(batch)({k: move_to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device) for v in batch)
    return batch


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch: the first dimension of its first tensor."""
    if type(batch) is dict:  # the usual batch: read its tensors here instead of one call each
        for value in batch.values():
            n = (int(value.shape[0]) if value.dim() else 1) if type(value) is torch.Tensor else batch_size_of(value)
            if n:
                return n
        return 0
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        for value in batch.values():
            n = batch_size_of(value)
            if n:
                return n
    if isinstance(batch, (list, tuple)):
        for value in batch:
            n = batch_size_of(value)
            if n:
                return n
    return 0


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """The value a wrapper tensor subclass carries, as a plain tensor. torchao's float8 all-gather keeps each
    weight as `WeightWithDynamicFloat8CastTensor`, whose data is its first inner tensor (the fp32 weight);
    such a wrapper has no storage of its own, so a file writer could not read it. A tensor that is not a
    wrapper, or whose first inner tensor is not of the wrapper's shape and dtype, is returned as it is."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        inner = getattr(t, attrs[0])
        if inner.shape != t.shape or inner.dtype != t.dtype:
            break
        t = inner
    return t
