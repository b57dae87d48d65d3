"""Loss weights of one accumulation window: each micro-batch counts in proportion to its items.

With `average_tokens_across_devices` (the default, as in HF) the step's gradient is that of the
mean loss over every item of the global window: micro-batch i is weighted n_i * dp / N, with N the
items summed over the dp data-parallel ranks (whose gradient averaging divides by dp again). N is
all-reduced in the background while the first forward runs and waited for only when the first
weight is needed. Without it each rank takes its own mean (n_i / n_local) and the ranks' means are
averaged, which needs no communication but weights a rank's items by how few it has.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch


class WindowWeights:
    def __init__(self, counts: list[torch.Tensor], dp: int, wait_total: Callable[[], torch.Tensor], *,
                 global_mean: bool, model_divides: bool) -> None:
        self.counts, self.dp, self.global_mean, self.model_divides = counts, dp, global_mean, model_divides
        self._wait: Optional[Callable[[], torch.Tensor]] = wait_total
        self._total: Optional[torch.Tensor] = None

    @property
    def total(self) -> torch.Tensor:
        """The items the loss averages over (what HF passes as `num_items_in_batch`): the global
        window's, or this rank's without `average_tokens_across_devices`."""
        if self._wait is not None:
            self._total, self._wait = self._wait(), None
        return self._total  # type: ignore[return-value]

    def weight(self, i: int) -> Any:
        """The factor for micro-batch i's loss (None: leave the loss as it is)."""
        scale = self.dp if self.global_mean else 1  # undoes DDP's averaging for a global mean
        if self.model_divides:  # the model divides by `total` itself
            return None if scale == 1 else scale
        return self.counts[i] * scale / self.total
