"""Static shapes for strategies that compile one graph per input shape (`Strategy.static_shapes`, XLA).

The short last batch of a training epoch (the dataset length not a multiple of the batch size) would
be a new shape, and so a new compilation, in every such run. Such strategies train with
`dataloader_drop_last` on instead, and this module says once how many samples that leaves out of each
epoch. Padding the batch with masked rows was not chosen: it is exact only when the loss ignores the
masked rows, which kiln cannot know of an arbitrary `training_step` (a mean over the rows would count
them). A short accumulation window (fewer micro-batches than `gradient_accumulation_steps`) keeps its
shapes already; its item counts are padded with zeros in `Trainer.loss_weights`."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def samples_dropped(dataset: Any, loader: Any, shards: int) -> int | None:
    """Samples of `dataset` that no batch of the drop_last `loader` carries in one epoch, over all
    `shards` (None when the dataset or the loader has no length)."""
    try:
        kept = len(loader) * int(loader.batch_size) * shards
        return max(len(dataset) - kept, 0)
    except (TypeError, AttributeError):
        return None


def report_drop_last(dataset: Any, loader: Any, shards: int, strategy: str) -> None:
    """The one log line saying what static shapes cost (nothing when no sample is left out)."""
    dropped = samples_dropped(dataset, loader, shards)
    if dropped == 0:
        return
    what = f"{dropped} sample(s)" if dropped is not None else "the short last batch"
    log.warning(
        "Strategy %r compiles one graph per input shape, so training drops %s of each epoch (the short "
        "last batch, as dataloader_drop_last does) instead of compiling a graph for it; shuffling changes "
        "which samples each epoch.",
        strategy,
        what,
    )
