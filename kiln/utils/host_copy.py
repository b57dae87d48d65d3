"""Snapshots of tensor trees in host memory, for a checkpoint written while training goes on.

Training changes weights and optimizer state in place, so an asynchronous save copies them at the step
boundary and writes the copy in the background. The copy must write the same bytes a synchronous save
would: each storage is copied once and every tensor becomes a view of its copy at the same offset,
shape and strides, so tied weights stay tied (safetensors stores them once) and `torch.save` lays out
the same storages. Device tensors go to pinned memory (copied without blocking, one synchronize at the
end) when CUDA is present; containers are rebuilt, because an optimizer's `state_dict()` hands out its
live per-parameter dicts.

`HostStaging` keeps the host buffers of one copy for the next: a run's parameters and optimizer state
keep their storages from save to save, so each later save copies into memory that is already
allocated (and pinned, and paged in) rather than allocating it again, which costs more than the copy.
The caller must be done with a copy before it makes the next one (one save in flight)."""

from __future__ import annotations

from typing import Any

import torch

#: a storage in a copy: its device type and address (a key that tells storages apart within one copy)
_Key = tuple[str, int]
#: a host buffer kept for the next copy: the source storage's device type, address and size
_BufferKey = tuple[str, int, int]


def host_copy(tree: Any) -> Any:
    """A copy of `tree` (dicts, lists, tuples, tensors, plain values) whose tensors live in host memory
    and share nothing with the originals; storages shared inside `tree` stay shared in the copy."""
    return HostStaging().copy(tree)


class HostStaging:
    """Host copies of one tree after another, reusing the previous copy's buffers where a storage
    has the same address and size as before. A copy's tensors are overwritten by the next copy."""

    def __init__(self) -> None:
        self._buffers: dict[_BufferKey, torch.UntypedStorage] = {}

    def copy(self, tree: Any) -> Any:
        """See `host_copy`; buffers of the previous copy that this one does not use are let go."""
        copies: dict[_Key, torch.UntypedStorage] = {}
        used: dict[_BufferKey, torch.UntypedStorage] = {}
        copied = _copy(tree, _Copier(copies, used, self._buffers), {})
        self._buffers = used
        if any(key[0] == "cuda" for key in copies):
            torch.cuda.synchronize()  # the pinned copies were made without blocking
        return copied


class _Copier:
    def __init__(
        self,
        copies: dict[_Key, torch.UntypedStorage],
        used: dict[_BufferKey, torch.UntypedStorage],
        previous: dict[_BufferKey, torch.UntypedStorage],
    ) -> None:
        self.copies, self.used, self.previous = copies, used, previous

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:  # every empty storage has data_ptr 0: never treat two as one
            return torch.empty(tensor.shape, dtype=tensor.dtype)
        key = (tensor.device.type, storage.data_ptr())
        copy = self.copies.get(key)
        if copy is None:
            copy = self.copies[key] = self._storage(tensor.device, storage)
        return torch.empty(0, dtype=tensor.dtype).set_(copy, tensor.storage_offset(), tensor.shape, tensor.stride())

    def _storage(self, device: torch.device, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        pin = device.type == "cuda"
        reuse_key = (device.type, storage.data_ptr(), storage.nbytes())
        buffer: torch.UntypedStorage | None = self.previous.get(reuse_key)
        if buffer is not None:
            host = torch.empty(0, dtype=torch.uint8).set_(buffer)
        else:
            host = torch.empty(source.shape, dtype=torch.uint8, pin_memory=pin)
        host.copy_(source, non_blocking=pin)
        self.used[reuse_key] = host.untyped_storage()
        return self.used[reuse_key]


def _copy(value: Any, copier: _Copier, seen: dict[int, Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return copier.tensor(value)
    if not isinstance(value, (dict, list, tuple)) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return value  # numbers, strings, None: immutable
    if id(value) in seen:
        return seen[id(value)]
    if isinstance(value, dict):
        copy: Any = type(value)((k, _copy(v, copier, seen)) for k, v in value.items())
    elif isinstance(value, list):
        copy = [_copy(v, copier, seen) for v in value]
    else:
        copy = tuple(_copy(v, copier, seen) for v in value)
    seen[id(value)] = copy
    return copy
