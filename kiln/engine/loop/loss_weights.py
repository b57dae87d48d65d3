"""Loss weights of one accumulation window: each micro-batch counts in proportion to its items.

With `average_tokens_across_devices` (the default, as in HF) the step's gradient is that of the
mean loss over every item of the global window: micro-batch i is weighted n_i * d / N, with N the
items summed over the strategy's item shards (its data shards, or data shards x cp ranks when
context parallelism splits each sequence) and d its `grad_divisor` (what its gradient reduction
divides by: DDP's world size, 1 for SPMD). N is all-reduced in the background while the first
forward runs and waited for only when the first weight is needed. Without it each shard takes its
own mean (n_i / n_local) and the shards' means are averaged, which needs no communication but
weights a shard's items by how few it has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class WindowWeights:
    """`scale` is what every weight is multiplied by: d for a global mean, d / shards otherwise."""

    def __init__(
        self,
        counts: list[torch.Tensor],
        scale: float,
        wait_total: Callable[[], torch.Tensor],
        *,
        global_mean: bool,
        model_divides: bool,
    ) -> None:
        self.counts, self.scale, self.global_mean, self.model_divides = counts, scale, global_mean, model_divides
        self._wait: Callable[[], torch.Tensor] | None = wait_total
        self._total: torch.Tensor | None = None

    @classmethod
    def for_window(
        cls,
        counts: list[torch.Tensor],
        *,
        item_shards: int,
        grad_divisor: int,
        global_mean: bool,
        model_divides: bool,
        reduce_async: Callable[[torch.Tensor, str], Callable[[], torch.Tensor]],
    ) -> WindowWeights:
        total = torch.stack(counts).sum()
        global_mean = global_mean and item_shards > 1
        wait = reduce_async(total, "sum") if global_mean else (lambda: total)
        scale = grad_divisor if global_mean else grad_divisor / item_shards
        return cls(counts, scale, wait, global_mean=global_mean, model_divides=model_divides)

    @property
    def total(self) -> torch.Tensor:
        """The items the loss averages over (what HF passes as `num_items_in_batch`): the global
        window's, or this shard's without `average_tokens_across_devices`."""
        if self._wait is not None:
            self._total, self._wait = self._wait(), None
        return self._total  # type: ignore[return-value]

    def weight(self, i: int) -> Any:
        """The factor for micro-batch i's loss (None: leave the loss as it is)."""
        if self.model_divides:  # the model divides by `total` itself
            return None if self.scale == 1 else self.scale
        return self.counts[i] * self.scale / self.total


@dataclass
class MicroBatch:
    """Where a micro-batch sits in its accumulation window, handed to `Trainer.training_step`:
    its index, whether it is the window's last (the gradient-synchronisation boundary), and the
    window's loss weights (None: a lone micro-batch on one shard, whose mean loss needs none)."""

    index: int
    boundary: bool
    weights: WindowWeights | None = None

    @property
    def weight(self) -> Any:
        return self.weights.weight(self.index) if self.weights is not None else None
