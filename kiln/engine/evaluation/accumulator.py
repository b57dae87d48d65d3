"""`EvalAccumulator`: the evaluation loop's container for every step's outputs, kept on the device, flushed to CPU
numpy every `eval_accumulation_steps`, gathered across ranks and returned in dataset order."""

from __future__ import annotations

import operator
from typing import Any

from kiln.engine.evaluation.gather import GatherFn, OrderedGatherer, gather_across_processes
from kiln.engine.evaluation.nested import (
    nested_concat_all,
    nested_detach,
    nested_leaves,
    nested_map,
    nested_numpify,
    nested_rows,
    nested_truncate,
)


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
                per_rank = nested_rows(arrays) // self.gatherer.world_size
                for rank, chunks in enumerate(self._per_rank):
                    chunks.append(
                        nested_map(operator.itemgetter(slice(rank * per_rank, (rank + 1) * per_rank)), arrays)
                    )

    @property
    def held(self) -> list[Any]:
        """Every array or tensor this container holds right now (to check what sits on the device)."""
        trees = [*self._pending, *self._host, *(c for chunks in self._per_rank for c in chunks)]
        if self.gatherer is not None and self.gatherer._storage is not None:
            trees.append(self.gatherer._storage)
        return [leaf for tree in trees for leaf in nested_leaves(tree)]

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
            rows = nested_rows(chunk)
            batches.append(chunk if rows <= remaining else nested_truncate(chunk, remaining))
            remaining -= rows
        return batches
