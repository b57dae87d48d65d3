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

The evaluation loop drives all of this through `EvalAccumulator` (see its docstring);
`kiln.engine.loop.evaluation.EvaluationLoop` is the caller.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from kiln.engine.data.loaders import SequentialDistributedSampler  # re-exported: the loop's sampler and its gatherer

logger = logging.getLogger(__name__)

Array = torch.Tensor | np.ndarray
ArrayT = TypeVar("ArrayT", torch.Tensor, np.ndarray)
GatherFn = Callable[[torch.Tensor], torch.Tensor]
"""A collective like `Strategy.all_gather`: every rank's tensor stacked along a new dim 0 (a
function that concatenates along dim 0 instead is accepted too)."""


# -- walking nested structures ------------------------------------------------------------------
def _map(fn: Callable[..., Any], *trees: Any) -> Any:
    """Apply `fn` leaf-wise to structurally identical trees of tuples/lists/dicts; None stays None."""
    first = trees[0]
    if first is None:
        return None
    if isinstance(first, Mapping):
        return {key: _map(fn, *(tree[key] for tree in trees)) for key in first}
    if isinstance(first, (list, tuple)):
        values = [_map(fn, *items) for items in zip(*trees)]
        return type(first)(*values) if hasattr(first, "_fields") else type(first)(values)
    return fn(*trees)


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, Mapping):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _leaves(item)
    elif tree is not None:
        yield tree


def _rows(tree: Any) -> int:
    """Rows (dim 0) of the first leaf of a tree; every leaf of one batch has the same count."""
    return next((int(leaf.shape[0]) if leaf.ndim else 1 for leaf in _leaves(tree)), 0)


# -- per-leaf conversions -----------------------------------------------------------------------
def nested_detach(tensors: Any) -> Any:
    """Detach every tensor, so that kept outputs do not hold the autograd graph alive."""
    return _map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tensors)


def nested_to_cpu(tensors: Any) -> Any:
    """Detach and move every tensor to the CPU (other leaves are returned as they are)."""
    return _map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, tensors)


def _numpify(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach().cpu()
    if t.is_floating_point() and t.dtype not in (torch.float16, torch.float32, torch.float64):
        t = t.float()  # bfloat16 and float8 have no numpy dtype
    return t.numpy()


def nested_numpify(tensors: Any) -> Any:
    """Move every tensor to CPU numpy; bf16 (and float8) become float32, which numpy can hold."""
    return _map(_numpify, tensors)


def nested_truncate(tensors: Any, limit: int) -> Any:
    """Keep the first `limit` rows of every leaf (drops the sampler's padding duplicates)."""
    return _map(lambda t: t[:limit], tensors)


# -- padding and concatenation ------------------------------------------------------------------
def _pad_to(x: ArrayT, shape: Sequence[int], padding_index: float) -> ArrayT:
    """`x` grown to `shape` with `padding_index` after the existing values in every dimension."""
    shape = tuple(int(s) for s in shape)
    if tuple(x.shape) == shape:
        return x
    if isinstance(x, torch.Tensor):
        out = x.new_full(shape, padding_index)
    else:
        out = np.full(shape, padding_index, dtype=x.dtype)
    out[tuple(slice(0, s) for s in x.shape)] = x
    return out


def concat_padded(arrays: Sequence[Array], padding_index: float = -100) -> Array:
    """Concatenate along dim 0 in ONE allocation, right-padding trailing dims to their maximum.

    Used instead of repeated pairwise concatenation so that joining n batches costs O(n), not O(n^2).
    0-d tensors (a scalar loss) count as one row.
    """
    if not arrays:
        raise ValueError("concat_padded needs at least one array.")
    if all(isinstance(a, torch.Tensor) for a in arrays):
        tensors = [torch.atleast_1d(a) for a in arrays]
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))

        def new_full(shape: tuple[int, ...]) -> Array:
            return tensors[0].new_full(shape, padding_index, dtype=dtype)
    elif all(isinstance(a, np.ndarray) for a in arrays):
        tensors = [np.atleast_1d(a) for a in arrays]
        np_dtype = np.result_type(*tensors)

        def new_full(shape: tuple[int, ...]) -> Array:
            return np.full(shape, padding_index, dtype=np_dtype)
    else:
        kinds = sorted({type(a).__name__ for a in arrays})
        raise TypeError(
            f"Cannot concatenate {kinds}: pass all torch tensors or all numpy arrays (nested_numpify first)"
        )
    if len({t.ndim for t in tensors}) != 1:
        raise ValueError(f"Cannot concatenate arrays with different ranks: {[tuple(t.shape) for t in tensors]}.")
    if len(tensors) == 1:
        return tensors[0]
    trailing = tuple(max(t.shape[d] for t in tensors) for d in range(1, tensors[0].ndim))
    if all(tuple(t.shape[1:]) == trailing for t in tensors):
        return torch.cat(tensors) if isinstance(tensors[0], torch.Tensor) else np.concatenate(tensors)
    out = new_full((sum(t.shape[0] for t in tensors), *trailing))
    row = 0
    for t in tensors:
        out[(slice(row, row + t.shape[0]), *(slice(0, s) for s in t.shape[1:]))] = t
        row += t.shape[0]
    return out


def pad_and_concat(a: Array, b: Array, padding_index: float = -100) -> Array:
    """Concatenate two tensors or two numpy arrays along dim 0; if their other dims differ
    (sequence lengths of two batches), pad both on the RIGHT with `padding_index` first."""
    return concat_padded([a, b], padding_index)


def nested_concat(a: Any, b: Any, padding_index: float = -100) -> Any:
    """`pad_and_concat` leaf-wise over matching tuples/lists/dicts; if `a` is None, returns `b`."""
    if a is None:
        return b
    return _map(lambda x, y: concat_padded([x, y], padding_index), a, b)


def nested_concat_all(items: Sequence[Any], padding_index: float = -100) -> Any:
    """Concatenate a list of same-structured batches leaf-wise in one allocation per leaf."""
    if not items:
        return None
    return _map(lambda *leaves: concat_padded(leaves, padding_index), *items)


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
    return _pad_to(tensor, sizes.max(dim=0).values.tolist(), padding_index)


def gather_across_processes(tensors: Any, gather_fn: GatherFn, padding_index: float = -100) -> Any:
    """Pad (see `pad_across_processes`) and all_gather every tensor of a nested structure; each
    result is rank-major, `[rank 0 rows, rank 1 rows, ...]`, as `OrderedGatherer.add_arrays` expects."""

    def gather(t: torch.Tensor) -> torch.Tensor:
        padded = pad_across_processes(torch.atleast_1d(t), gather_fn, padding_index)
        out = gather_fn(padded)
        return out.flatten(0, 1) if out.ndim == padded.ndim + 1 else out

    return _map(gather, tensors)


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
        rows = _rows(arrays)
        if rows % self.world_size:
            raise ValueError(f"A gathered chunk of {rows} rows does not split evenly over {self.world_size} ranks.")
        slice_len = rows // self.world_size
        if self._offsets[0] + slice_len > self.process_length:
            raise ValueError(
                f"Got more rows than each rank's shard holds ({self.process_length}); the sampler and "
                "the gatherer disagree (build the gatherer with OrderedGatherer.for_sampler)."
            )
        if self._storage is None:
            self._storage = _map(self._allocate, arrays)
        self._storage = _map(functools.partial(self._place, slice_len=slice_len), self._storage, arrays)
        self._offsets = [offset + slice_len for offset in self._offsets]

    def _allocate(self, array: np.ndarray) -> np.ndarray:
        return np.full((self.total_samples, *array.shape[1:]), self.padding_index, dtype=array.dtype)

    def _place(self, storage: np.ndarray, array: np.ndarray, slice_len: int) -> np.ndarray:
        if array.shape[0] != slice_len * self.world_size:
            rows = (array.shape[0], slice_len * self.world_size)
            raise ValueError(f"All outputs of one step must have the same number of rows; got {rows}.")
        if any(a > s for a, s in zip(array.shape[1:], storage.shape[1:])):
            grown = (storage.shape[0], *map(max, storage.shape[1:], array.shape[1:]))
            storage = _pad_to(storage, grown, self.padding_index)
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
        rows = _rows(gathered)
        per_rank = rows // self.world_size
        index = [
            rank * per_rank + j
            for rank in range(self.world_size)
            for j in range(per_rank)
            if rank * self.process_length + rows_before + j < self.num_samples
        ]
        if len(index) == rows:
            return gathered
        return _map(functools.partial(_take_rows, index=index), gathered)


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

    return _map(order, *gathered_per_rank)


# -- the evaluation loop's container ------------------------------------------------------------
class EvalAccumulator:
    """Collects the outputs of every eval step and returns them as numpy at the end.

    Per step the loop calls `add(outputs)` with this rank's (nested) tensors, still on the device.
    Every `accumulation_steps` calls (HF's `eval_accumulation_steps`), `add` flushes: the pending
    outputs are gathered across ranks (if `gather_fn` is set), moved to CPU numpy and placed in their
    final slots, so device memory stays bounded. With `accumulation_steps=None` everything stays on
    the device until `get_arrays()` (faster, more memory - HF's default). `to_cpu_and_numpy()` flushes
    on demand. Pending outputs are kept un-gathered, which costs 1/world_size of the memory.

    Distributed: pass `gather_fn=strategy.all_gather` and `gatherer=OrderedGatherer.for_sampler(...)`;
    every rank must call `add` equally often (the sampler guarantees equal step counts), because a
    flush runs collectives. If the loop gathers itself (e.g. for `batch_eval_metrics`), pass only the
    gatherer and add the gathered outputs.

    `get_arrays()` returns the outputs in dataset order: concatenated (sequence dims right-padded with
    `padding_index`), or with `do_concat_batches=False` a list with one entry per batch (in a
    distributed run: rank 0's batches, then rank 1's, ..., i.e. still dataset order, duplicates cut).
    """

    def __init__(
        self,
        padding_index: float = -100,
        do_concat_batches: bool = True,
        accumulation_steps: int | None = None,
        *,
        gather_fn: GatherFn | None = None,
        gatherer: OrderedGatherer | None = None,
    ) -> None:
        if gather_fn is not None and gatherer is None:
            raise ValueError(
                "gather_fn needs a gatherer to restore dataset order: "
                "pass gatherer=OrderedGatherer.for_sampler(sampler)."
            )
        if accumulation_steps is not None and accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be None or >= 1, got {accumulation_steps}.")
        self.padding_index = padding_index
        self.do_concat_batches = do_concat_batches
        self.accumulation_steps = accumulation_steps
        self.gather_fn = gather_fn
        self.gatherer = gatherer
        self.steps = 0
        self._pending: list[Any] = []  # per-step outputs, on the device
        self._host: list[Any] = []  # numpy chunks (single process, or do_concat_batches=False per rank)
        self._per_rank: list[list[Any]] = [[] for _ in range(gatherer.world_size)] if gatherer else []

    def add(self, outputs: Any) -> None:
        """Keep one step's outputs (None is allowed and still counts as a step); flush when due."""
        if outputs is not None:
            self._pending.append(nested_detach(outputs))
        self.steps += 1
        if self.accumulation_steps is not None and self.steps % self.accumulation_steps == 0:
            self.to_cpu_and_numpy()

    def to_cpu_and_numpy(self) -> None:
        """Gather (if distributed), move to CPU numpy and store everything pending; on all ranks."""
        pending, self._pending = self._pending, []
        for outputs in pending:
            if self.gather_fn is not None:
                outputs = gather_across_processes(outputs, self.gather_fn, self.padding_index)
            arrays = nested_numpify(outputs)
            if self.gatherer is None:
                self._host.append(arrays)
            elif self.do_concat_batches:
                self.gatherer.add_arrays(arrays)
            else:
                per_rank = _rows(arrays) // self.gatherer.world_size
                for rank, chunks in enumerate(self._per_rank):
                    chunks.append(_map(operator.itemgetter(slice(rank * per_rank, (rank + 1) * per_rank)), arrays))

    @property
    def held(self) -> list[Any]:
        """Every array or tensor this container holds right now (to check what sits on the device)."""
        trees = [*self._pending, *self._host, *(c for chunks in self._per_rank for c in chunks)]
        if self.gatherer is not None and self.gatherer._storage is not None:
            trees.append(self.gatherer._storage)
        return [leaf for tree in trees for leaf in _leaves(tree)]

    def get_arrays(self) -> Any:
        """Flush, then return the numpy outputs in dataset order (None if nothing was added)."""
        self.to_cpu_and_numpy()
        if self.gatherer is None:
            if self.do_concat_batches:
                return nested_concat_all(self._host, self.padding_index)
            return list(self._host)
        if self.do_concat_batches:
            return self.gatherer.finalize()
        batches, remaining = [], self.gatherer.num_samples
        for chunk in (c for chunks in self._per_rank for c in chunks):
            if remaining <= 0:
                break
            rows = _rows(chunk)
            batches.append(chunk if rows <= remaining else nested_truncate(chunk, remaining))
            remaining -= rows
        return batches
