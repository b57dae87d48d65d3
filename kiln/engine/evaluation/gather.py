"""The tensor logic of evaluation and prediction: concatenate ragged batches, move them off the
device in chunks, gather them across ranks and put them back in dataset order.

Nothing here talks to a process group: the collective is passed in as `gather_fn`, which follows
`Strategy.all_gather` (stack the tensor of every rank along a new first dimension). That keeps every
rule testable on one CPU and identical for DDP, FSDP, DeepSpeed and XLA.

Why ordering needs care. kiln's eval sampler (`SequentialDistributedSampler`, as in HF) gives each
rank one CONTIGUOUS shard of the index list, padded to equal length by repeating indices from the
start. An all_gather at each step therefore returns rows rank-major - [rank 0's batch, rank 1's
batch, ...] - which is not dataset order. `OrderedGatherer` writes every rank's rows at that rank's
offset and drops the padding duplicates at the end (HF's `DistributedTensorGatherer`).

The evaluation loop drives all of this through `EvalAccumulator` (accumulator.py);
`kiln.engine.loop.evaluation.EvaluationLoop` is the caller. Walking, converting and concatenating nested
outputs is in nested.py.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from kiln.engine.data.samplers import SequentialDistributedSampler  # re-exported: the loop's sampler and its gatherer
from kiln.engine.evaluation.nested import Array, concat_padded, nested_map, nested_rows, nested_truncate, pad_to

logger = logging.getLogger(__name__)

GatherFn = Callable[[torch.Tensor], torch.Tensor]
"""A collective like `Strategy.all_gather`: every rank's tensor stacked along a new dim 0 (a
function that concatenates along dim 0 instead is accepted too)."""


# -- across processes ---------------------------------------------------------------------------
def pad_across_processes(tensor: torch.Tensor, gather_fn: GatherFn, padding_index: float = -100) -> torch.Tensor:
    """Right-pad every dim but the first to its maximum over all ranks, so all_gather can stack.

    A collective: call it on every rank. It gathers the shapes first (one small all_gather), so ranks
    whose batches had different sequence lengths agree on the padded shape. Dim 0 must already match
    on every rank (SequentialDistributedSampler guarantees equal batch sizes).
    """
    if tensor.ndim == 0:
        return tensor
    shape = torch.tensor(tensor.shape, device=tensor.device, dtype=torch.int64)
    sizes = gather_fn(shape).reshape(-1, tensor.ndim).cpu()
    if bool((sizes[:, 0] != sizes[0, 0]).any()):
        raise ValueError(
            f"Ranks hold different numbers of rows {sizes[:, 0].tolist()}; evaluation needs equal batch sizes "
            "per step on every rank (use SequentialDistributedSampler and the same eval batch size everywhere)."
        )
    return pad_to(tensor, sizes.max(dim=0).values.tolist(), padding_index)


def gather_across_processes(tensors: Any, gather_fn: GatherFn, padding_index: float = -100) -> Any:
    """Pad (see `pad_across_processes`) and all_gather every tensor of a nested structure; each
    result is rank-major, `[rank 0 rows, rank 1 rows, ...]`, as `OrderedGatherer.add_arrays` expects."""

    def gather(t: torch.Tensor) -> torch.Tensor:
        padded = pad_across_processes(torch.atleast_1d(t), gather_fn, padding_index)
        out = gather_fn(padded)
        return out.flatten(0, 1) if out.ndim == padded.ndim + 1 else out

    return nested_map(gather, tensors)


# -- sample order -------------------------------------------------------------------------------
class OrderedGatherer:
    """HF's `DistributedTensorGatherer`: puts rank-major gathered chunks back into dataset order on
    the CPU, for a sampler that gives every rank one contiguous shard of `process_length` samples.

    `add_arrays` takes, for each step or flush, the rank-major concatenation of every rank's chunk
    (equal-sized chunks; any chunk size); storage for the whole dataset is allocated on the first
    call so that an out-of-memory error happens at the start, not after an hour of evaluation. Later
    chunks with longer sequences grow the storage, padding with `padding_index`. `finalize` returns
    the arrays truncated to `num_samples`, dropping the sampler's padding duplicates.
    """

    def __init__(
        self, world_size: int, num_samples: int, make_multiple_of: int | None = None, padding_index: float = -100
    ) -> None:
        self.world_size = world_size
        self.num_samples = num_samples
        total = world_size * (make_multiple_of or 1)
        self.total_samples = math.ceil(num_samples / total) * total
        self.process_length = self.total_samples // world_size
        self.padding_index = padding_index
        self._storage: Any = None
        self._offsets = [r * self.process_length for r in range(world_size)]

    @classmethod
    def for_sampler(cls, sampler: SequentialDistributedSampler, padding_index: float = -100) -> OrderedGatherer:
        """The gatherer whose layout is `sampler`'s, by construction."""
        return cls(sampler.num_replicas, sampler.num_examples, sampler.batch_size, padding_index)

    def add_arrays(self, arrays: Any) -> None:
        """Place one rank-major chunk (numpy, or a nested tuple/list/dict of numpy) in its slots."""
        if arrays is None:
            return
        rows = nested_rows(arrays)
        if rows % self.world_size:
            raise ValueError(f"A gathered chunk of {rows} rows does not split evenly over {self.world_size} ranks.")
        slice_len = rows // self.world_size
        if self._offsets[0] + slice_len > self.process_length:
            raise ValueError(
                f"Got more rows than each rank's shard holds ({self.process_length}); the sampler and "
                "the gatherer disagree (build the gatherer with OrderedGatherer.for_sampler)."
            )
        if self._storage is None:
            self._storage = nested_map(self._allocate, arrays)
        self._storage = nested_map(functools.partial(self._place, slice_len=slice_len), self._storage, arrays)
        self._offsets = [offset + slice_len for offset in self._offsets]

    def _allocate(self, array: np.ndarray) -> np.ndarray:
        return np.full((self.total_samples, *array.shape[1:]), self.padding_index, dtype=array.dtype)

    def _place(self, storage: np.ndarray, array: np.ndarray, slice_len: int) -> np.ndarray:
        if array.shape[0] != slice_len * self.world_size:
            rows = (array.shape[0], slice_len * self.world_size)
            raise ValueError(f"All outputs of one step must have the same number of rows; got {rows}.")
        if any(a > s for a, s in zip(array.shape[1:], storage.shape[1:])):
            grown = (storage.shape[0], *map(max, storage.shape[1:], array.shape[1:]))
            storage = pad_to(storage, grown, self.padding_index)
        tail = tuple(slice(0, s) for s in array.shape[1:])
        for rank, offset in enumerate(self._offsets):
            storage[(slice(offset, offset + slice_len), *tail)] = array[rank * slice_len : (rank + 1) * slice_len]
        return storage

    def finalize(self) -> Any:
        """The arrays in dataset order, truncated to `num_samples` (None if nothing was added)."""
        if self._storage is None:
            return None
        if self._offsets[0] != self.process_length:
            logger.warning(
                "OrderedGatherer got %d of %d rows per rank; the rest stay padding.",
                self._offsets[0],
                self.process_length,
            )
        return nested_truncate(self._storage, self.num_samples)

    def drop_duplicates(self, gathered: Any, rows_before: int) -> Any:
        """Drop the sampler's padding rows from one rank-major gathered step (for `batch_eval_metrics`,
        where each step's outputs go to `compute_metrics` instead of being stored).

        `rows_before` is how many rows each rank had produced before this step. Order within the
        result stays rank-major, which is fine for metrics that only accumulate statistics.
        """
        rows = nested_rows(gathered)
        per_rank = rows // self.world_size
        index = [
            rank * per_rank + j
            for rank in range(self.world_size)
            for j in range(per_rank)
            if rank * self.process_length + rows_before + j < self.num_samples
        ]
        if len(index) == rows:
            return gathered
        return nested_map(functools.partial(_take_rows, index=index), gathered)


def _take_rows(x: Array, index: list[int]) -> Array:
    return x[torch.tensor(index, dtype=torch.long, device=x.device)] if isinstance(x, torch.Tensor) else x[index]


def restore_order(
    gathered_per_rank: Sequence[Any],
    num_samples: int,
    layout: Literal["contiguous", "strided"] = "contiguous",
    padding_index: float = -100,
) -> Any:
    """Dataset-ordered outputs from each rank's complete outputs (e.g. from one all_gather_object).

    `gathered_per_rank[r]` is everything rank r produced, in its sampler's order, and all ranks hold
    the same number of rows (both samplers pad to that by repeating indices from the start).
    - "contiguous": `SequentialDistributedSampler` - rank r holds samples `[r*n, (r+1)*n)`.
    - "strided": `torch.utils.data.DistributedSampler(shuffle=False)` - rank r holds `r, r+W, r+2W, ...`.
    Ragged trailing dims are right-padded with `padding_index`; the result is cut to `num_samples`.
    """
    world_size = len(gathered_per_rank)

    def order(*parts: Array) -> Array:
        joined = concat_padded(parts, padding_index)  # rank-major: rank r's rows at [r*n, (r+1)*n)
        if layout == "strided":
            n = joined.shape[0] // world_size
            # position r*n + j holds sample j*W + r: read it back sample by sample
            perm = [(i % world_size) * n + i // world_size for i in range(joined.shape[0])]
            joined = _take_rows(joined, perm)
        elif layout != "contiguous":
            raise ValueError(f"layout must be 'contiguous' or 'strided', got {layout!r}.")
        return joined[:num_samples]

    return nested_map(order, *gathered_per_rank)
