"""accelerate's `split_batches` and `dispatch_batches` for kiln's training dataloader.

`split_batches`: the configured batch size is the global one; each data-parallel rank loads
`batch_size / world` samples. `dispatch_batches`: only rank 0 iterates the data (a stream that
cannot shard itself, or one that must be read once); it collates each global batch and every rank
receives it by broadcast and keeps its own slice. Slicing keeps the layout of kiln's sharded sampler
(rank r takes the rows r, r + world, r + 2·world, ... of the global batch), so one step sees the same
samples either way."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from kiln.utils.errors import ConfigError


def per_rank_batch_size(batch_size: int, split_batches: bool, world: int, key: str) -> int:
    """The batch one rank loads: the configured size, or with `split_batches` its share of it."""
    if not split_batches or world == 1:
        return batch_size
    if batch_size % world:
        raise ConfigError(
            f"split_batches divides {key}={batch_size} over {world} ranks; make it a multiple of {world}."
        )
    return batch_size // world


def _batch_rows(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        return _batch_rows(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return _batch_rows(batch[0])
    raise TypeError(f"dispatch_batches cannot slice a batch of type {type(batch).__name__}; collate to tensors.")


def _take(batch: Any, rows: torch.Tensor) -> Any:
    """The given rows of every tensor in a (nested) batch; non-tensor leaves are kept whole."""
    if isinstance(batch, torch.Tensor):
        return batch.index_select(0, rows)
    if isinstance(batch, Mapping):
        return {k: _take(v, rows) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_take(v, rows) for v in batch)
    if isinstance(batch, list):
        return [_take(v, rows) for v in batch]
    return batch


def slice_rows(rows: int, world: int, rank: int, even: bool) -> list[int] | None:
    """Row indices of a global batch of `rows` that rank `rank` keeps (strided, like the sampler).

    `even`: a short batch is padded by repeating its first rows so that every rank gets
    ceil(rows / world); otherwise ranks keep 0 or 1 rows fewer, and None means this rank would get
    nothing (fewer rows than ranks) so the epoch ends for everyone."""
    if even:
        per_rank = math.ceil(rows / world)
        return [i % rows for i in range(rank, per_rank * world, world)]
    if rows < world:
        return None
    return list(range(rank, rows, world))


_END = "__kiln_end_of_data__"


class DispatchedLoader:
    """Rank 0 iterates `loader` (global batches) and broadcasts each; every rank yields its slice.

    Looks like a DataLoader to kiln's epoch seeding and resume helpers: `sampler`, `dataset`,
    `generator` and `batch_size` are the wrapped loader's (on every rank; only rank 0 iterates)."""

    def __init__(self, loader: Any, broadcast: Callable[[Any], Any], world: int, rank: int, even: bool) -> None:
        self.loader = loader
        self.broadcast = broadcast
        self.world, self.rank, self.even = world, rank, even
        self.sampler: Any = getattr(loader, "sampler", None)
        self.dataset = getattr(loader, "dataset", None)
        self.generator = getattr(loader, "generator", None)
        self.batch_size = getattr(loader, "batch_size", None)  # global: resume jumps in global batches

    def __iter__(self) -> Iterator[Any]:
        # made now, not at the first batch: the fit loop restores a resumed run's RNG after this call
        if self.rank == 0:
            return self._batches(iter(self.loader))
        from kiln.engine.data.global_draw import global_draw

        global_draw()  # what rank 0's iterator draws: every rank's global RNG moves alike (as accelerate's)
        return self._batches(None)

    def _batches(self, source: Iterator[Any] | None) -> Iterator[Any]:
        while True:
            batch = next(source, _END) if source is not None else None
            batch = self.broadcast(batch)  # every rank calls it once per batch, so none can hang
            if isinstance(batch, str) and batch == _END:
                return
            rows = slice_rows(_batch_rows(batch), self.world, self.rank, self.even)
            if rows is None:  # fewer samples than ranks left; the same decision on every rank
                return
            yield _take(batch, torch.tensor(rows, dtype=torch.long))

    def __len__(self) -> int:
        n = len(self.loader)
        if self.even or self.batch_size is None or not hasattr(self.sampler, "__len__"):
            return n
        last = len(self.sampler) % self.batch_size
        return n - 1 if 0 < last < self.world else n
