"""Snapshots of tensor trees in host memory, for a checkpoint written while training goes on.

Training changes weights and optimizer state in place, so an asynchronous save copies them at the step
boundary and writes the copy in the background. The copy must write the same bytes a synchronous save
would: each storage is copied once and every tensor becomes a view of its copy at the same offset,
shape and strides, so tied weights stay tied (safetensors stores them once) and `torch.save` lays out
the same storages. Device tensors go to pinned memory (copied without blocking, one synchronize at the
end) when CUDA is present; containers are rebuilt, because an optimizer's `state_dict()` hands out its
live per-parameter dicts. A DTensor becomes a DTensor of the same spec around a host copy of its shard.

`HostStaging` keeps the host buffers of one copy for the next: a run's parameters and optimizer state
keep their storages from save to save, so each later save copies into memory that is already
allocated (and pinned, and paged in) rather than allocating it again, which costs more than the copy.
The caller must be done with a copy before it makes the next one (one save in flight).

A copy can leave the bytes of some tensors to a thread of its own (`copy(tree, later=...)`): the
copied tree is built at once, with host buffers for every tensor, and the thread fills the deferred
ones while the caller goes on, so the step loop does not wait for the bulk of the copy. Valid only for
tensors nothing changes until `wait()` returns: the checkpoint manager defers the parameters and the
optimizer state, and `guard(optimizer)` makes the optimizer's next step wait for the copy (buffers,
which a forward pass changes in place, are copied at once). A tensor changed while its copy was
pending is caught by its version counter: the copy then fails (`error`) rather than hold a torn
snapshot. Host tensors only: a device's copies are already asynchronous (pinned, non-blocking)."""

from __future__ import annotations

import threading
from collections.abc import Callable
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
        self._pending: threading.Thread | None = None  # the thread filling the last copy's deferred tensors
        self._guarded: set[int] = set()  # ids of the optimizers whose step waits for it
        #: why the last copy's deferred part is not a snapshot (a tensor changed while it was pending)
        self.error: str | None = None

    def copy(self, tree: Any, later: Callable[[torch.Tensor], bool] | None = None) -> Any:
        """See `host_copy`; buffers of the previous copy that this one does not use are let go. The
        host tensors `later` picks are copied on a thread started here (see the module docstring)."""
        self.wait()
        copies: dict[_Key, torch.UntypedStorage] = {}
        used: dict[_BufferKey, torch.UntypedStorage] = {}
        copier = _Copier(copies, used, self._buffers, later)
        copied = _copy(tree, copier, {})
        self._buffers = used
        if any(key[0] == "cuda" for key in copies):
            torch.cuda.synchronize()  # the pinned copies were made without blocking
        self.error = None
        if copier.deferred:
            self._pending = threading.Thread(target=self._fill, args=(copier.deferred,), name="kiln-host-copy")
            self._pending.start()
        return copied

    def wait(self) -> None:
        """Block until the deferred tensors of the last copy are copied (then `error` says whether
        the copy is a snapshot)."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `optimizer.step()` wait for the deferred copy first (once per optimizer): the step is
        what changes the parameters and the optimizer state in place."""
        if id(optimizer) not in self._guarded:
            self._guarded.add(id(optimizer))
            optimizer.register_step_pre_hook(lambda *_: self.wait())

    def _fill(self, deferred: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]) -> None:
        for host, source, tensor, version in deferred:
            host.copy_(source)  # releases the GIL: the step loop runs on meanwhile
            if tensor._version != version:  # `tensor` shares the version counter of what the caller gave
                self.error = (
                    f"a tensor of shape {tuple(tensor.shape)} was changed in place while the background save "
                    "copied it; only the optimizer's step may change the parameters and optimizer state "
                    "between steps"
                )


class _Copier:
    def __init__(
        self,
        copies: dict[_Key, torch.UntypedStorage],
        used: dict[_BufferKey, torch.UntypedStorage],
        previous: dict[_BufferKey, torch.UntypedStorage],
        later: Callable[[torch.Tensor], bool] | None = None,
    ) -> None:
        self.copies, self.used, self.previous, self.later = copies, used, previous, later
        #: (host bytes, source bytes, the tensor given, its version when staged)
        self.deferred: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:  # every empty storage has data_ptr 0: never treat two as one
            return torch.empty(tensor.shape, dtype=tensor.dtype)
        key = (tensor.device.type, storage.data_ptr())
        copy = self.copies.get(key)
        if copy is None:
            defer = self.later is not None and tensor.device.type == "cpu" and self.later(tensor)
            copy = self.copies[key] = self._storage(tensor, storage, defer)
        return torch.empty(0, dtype=tensor.dtype).set_(copy, tensor.storage_offset(), tensor.shape, tensor.stride())

    def _storage(self, tensor: torch.Tensor, storage: torch.UntypedStorage, defer: bool) -> torch.UntypedStorage:
        device = tensor.device
        source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        pin = device.type == "cuda"
        reuse_key = (device.type, storage.data_ptr(), storage.nbytes())
        buffer: torch.UntypedStorage | None = self.previous.get(reuse_key)
        if buffer is not None:
            host = torch.empty(0, dtype=torch.uint8).set_(buffer)
        else:
            host = torch.empty(source.shape, dtype=torch.uint8, pin_memory=pin)
        if defer:
            self.deferred.append((host, source, tensor, tensor._version))
        else:
            host.copy_(source, non_blocking=pin)
        self.used[reuse_key] = host.untyped_storage()
        return self.used[reuse_key]


def _copy(value: Any, copier: _Copier, seen: dict[int, Any]) -> Any:
    if isinstance(value, torch.Tensor):
        if hasattr(value, "__tensor_flatten__"):
            return _copy_wrapper(value, copier, seen)
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


def _copy_wrapper(value: torch.Tensor, copier: _Copier, seen: dict[int, Any]) -> torch.Tensor:
    """A tensor subclass that wraps others (a DTensor and its local shard): its inner tensors copied,
    rebuilt around the same metadata. A DTensor's copy keeps its mesh and placements while its shard is
    in host memory (`DTensor.from_local` would move the shard back to the mesh's device)."""
    names, context = value.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {name: _copy(getattr(value, name), copier, seen) for name in names}
    return type(value).__tensor_unflatten__(inner, context, value.size(), value.stride())  # type: ignore[attr-defined]
