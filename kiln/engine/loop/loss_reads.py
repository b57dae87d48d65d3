"""Reading the queued step losses back to the host, at a log or save step (never between them)."""

from __future__ import annotations

import torch


def loss_values(losses: list[torch.Tensor]) -> list[float]:
    """The values of `losses` (0-dim or one-element tensors, all on one device), in order.

    On an accelerator they are stacked and read in one transfer: one copy to wait for instead of one
    per loss. In host memory there is nothing to wait for, and reading each directly costs less than
    the stack: about 11 µs against 25 µs for ten losses, measured between the steps of a tiny model,
    where this code runs with cold caches."""
    if losses[0].is_cpu:
        return [loss.item() for loss in losses]
    flat = torch.stack(losses)
    return (flat if flat.dim() == 1 else flat.reshape(-1)).tolist()  # a custom step may return shape (1,)
