"""Snapshots of tensor trees in host memory, for a checkpoint written while training goes on.

Training changes weights and optimizer state in place, so an asynchronous save copies them at the step
boundary and writes the copy in the background. The copy must write the same bytes a synchronous save
would: each storage is copied once and every tensor becomes a view of its copy at the same offset,
shape and strides, so tied weights stay tied (safetensors stores them once) and `torch.save` lays out
the same storages. Device tensors go to pinned memory (copied without blocking, one synchronize at the
end) when CUDA is present; containers are rebuilt, because an optimizer's `state_dict()` hands out its
live per-parameter dicts."""

from __future__ import annotations

from typing import Any

import torch


def host_copy(tree: Any) -> Any:
    """A copy of `tree` (dicts, lists, tuples, tensors, plain values) whose tensors live in host memory
    and share nothing with the originals; storages shared inside `tree` stay shared in the copy."""
    copies: dict[tuple[str, int], torch.UntypedStorage] = {}
    copied = _copy(tree, copies, {})
    if any(key[0] == "cuda" for key in copies):
        torch.cuda.synchronize()  # the pinned copies were made without blocking
    return copied


def _copy(value: Any, copies: dict[tuple[str, int], torch.UntypedStorage], seen: dict[int, Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return _copy_tensor(value, copies)
    if not isinstance(value, (dict, list, tuple)) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return value  # numbers, strings, None: immutable
    if id(value) in seen:
        return seen[id(value)]
    if isinstance(value, dict):
        copy: Any = type(value)((k, _copy(v, copies, seen)) for k, v in value.items())
    elif isinstance(value, list):
        copy = [_copy(v, copies, seen) for v in value]
    else:
        copy = tuple(_copy(v, copies, seen) for v in value)
    seen[id(value)] = copy
    return copy


def _copy_tensor(tensor: torch.Tensor, copies: dict[tuple[str, int], torch.UntypedStorage]) -> torch.Tensor:
    tensor = tensor.detach()
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:  # every empty storage has data_ptr 0: never treat two as one
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    key = (tensor.device.type, storage.data_ptr())
    copy = copies.get(key)
    if copy is None:
        source = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        if tensor.device.type == "cpu":
            host = source.clone()
        else:
            pin = tensor.device.type == "cuda"
            host = torch.empty(source.shape, dtype=torch.uint8, pin_memory=pin)
            host.copy_(source, non_blocking=pin)
        copy = copies[key] = host.untyped_storage()
    return torch.empty(0, dtype=tensor.dtype).set_(copy, tensor.storage_offset(), tensor.shape, tensor.stride())
