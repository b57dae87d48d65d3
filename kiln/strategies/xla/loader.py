"""Feeding XLA devices: batches are copied to the device by torch_xla's `MpDeviceLoader` (a
background thread uploads the next batches while the device runs the current step), behind a
wrapper that still looks like the user's DataLoader to the loop (length, sampler, `set_epoch`,
resume skipping), so `kiln/engine/` never knows it is there.

Static shapes: XLA compiles one graph per input shape. The loaders kiln builds drop the short last
batch (`Capabilities.static_shapes`, kiln.engine.data.static_shapes); a DataLoader the user built is used
as given, and its short last batch (the dataset length not a multiple of the batch size) costs one
more compilation, once (the graph is cached for later epochs). `static_shape_warning` says so once."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)


class XLADeviceLoader:
    """Iterates `loader` through `MpDeviceLoader(loader, device, **kwargs)`; everything else
    (len, sampler, batch_size, dataset, set_epoch...) is the wrapped loader's."""

    def __init__(self, loader: Any, device: Any, *, prepare: Callable[[Any], Any] | None = None, **kwargs: Any) -> None:
        self._loader = loader
        self._device = device
        self._prepare = prepare  # e.g. SPMD's batch sharding annotations, once the batch is on the device
        self._kwargs = kwargs

    def __iter__(self) -> Iterator[Any]:
        import torch_xla.distributed.parallel_loader as pl

        batches = iter(pl.MpDeviceLoader(self._loader, self._device, **self._kwargs))
        if self._prepare is None:
            return batches
        return (self._prepare(batch) for batch in batches)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_loader", "_device", "_prepare", "_kwargs"):
            raise AttributeError(name)
        return getattr(self._loader, name)


def short_last_batch(loader: Any) -> tuple[int, int] | None:
    """(rows of the last batch, batch size) when a map-style DataLoader ends with a short batch."""
    batch_size = getattr(loader, "batch_size", None)
    sampler = getattr(loader, "sampler", None)
    if not batch_size or getattr(loader, "drop_last", True) or sampler is None:
        return None
    try:
        rows = len(sampler)
    except TypeError:  # an iterable dataset: its length is unknown
        return None
    last = rows % batch_size
    return (last, batch_size) if last else None


def static_shape_warning(loader: Any) -> None:
    short = short_last_batch(loader)
    if short is not None:
        log.warning(
            "XLA: the last batch of each epoch has %d rows instead of %d, so XLA compiles one more graph "
            "for it (once); build the DataLoader with drop_last=True to keep a single shape.",
            *short,
        )
