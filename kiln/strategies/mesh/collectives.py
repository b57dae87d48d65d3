"""`MeshCollectives`: the collectives of the mesh strategy, where the tp ranks of one position hold copies of
the same values. Sums and means count each distinct value once (they run over the `dp x cp` ranks at this rank's
tp position); `all_gather` / `all_gather_object` keep one entry per data shard (its first rank's); max / min,
`broadcast_object` and `barrier` span every rank, as ProcessGroupCollectives' do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.strategies.collectives import ProcessGroupCollectives, check_op
from kiln.strategies.mesh.dims import ParallelDims


class MeshCollectives(ProcessGroupCollectives):
    """ProcessGroupCollectives narrowed to distinct values; the mesh strategy sets `shape` and, once its mesh
    exists, `_dp_group` (the flattened dp x cp axes of this rank's tp position)."""

    shape: ParallelDims
    _dp_group: Any

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """sum and mean span the ranks whose values differ: the data shards and, within one, the cp
        ranks (each holds its own chunk of the sequences, so item and token counts, FLOPs and the
        loss weighted by them add up over dp x cp: each token once); the tp ranks of one position
        hold copies and count once (the reduction runs over the ranks at this rank's tp position,
        `dp x cp` of them). A value that is the same on the cp ranks of one data shard (per sample:
        a sample count, anything from evaluation, which is not context parallel) must be reduced with
        mean, max or min -- a sum would count it cp times. kiln's training loop sums only values
        counted on the rank's own chunk. max / min span every rank."""
        if op in ("max", "min") or self.shape.tp == 1:  # without tp every rank holds distinct data
            return super().reduce(tensor, op)
        return self._reduce_over_data(tensor, op)

    def _reduce_over_data(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """sum or mean over `_dp_group`, the ranks whose data differ (`dp x cp` of them; None: this rank alone)."""
        import torch.distributed as dist

        check_op(op)
        t = self._comm(torch.as_tensor(tensor))
        if op == "mean" and not t.is_floating_point():
            t = t.double()
        if self._dp_group is not None:
            dist.all_reduce(t, group=self._dp_group)
        if op == "mean":
            t = t / self.shape.dp_cp
        return t.to(torch.as_tensor(tensor).device)

    def reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Callable[[], torch.Tensor]:
        if op != "sum" or self.shape.tp == 1:
            return super().reduce_async(tensor, op)
        return self._sum_over_data_async(tensor)

    def _sum_over_data_async(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        """`_reduce_over_data`'s sum, started now; the returned call waits for it."""
        import torch.distributed as dist

        t, device = self._comm(torch.as_tensor(tensor)), torch.as_tensor(tensor).device
        work = dist.all_reduce(t, group=self._dp_group, async_op=True) if self._dp_group is not None else None

        def wait() -> torch.Tensor:
            if work is not None:
                work.wait()
            return t.to(device)

        return wait

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return super().all_gather(tensor)[:: self.shape.model_ranks]

    def all_gather_object(self, obj: Any) -> list[Any]:
        return super().all_gather_object(obj)[:: self.shape.model_ranks]
