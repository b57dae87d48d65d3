"""`auto_find_batch_size` during training: an out-of-memory error in a window's forward/backward
shrinks the micro-batch and redoes the same optimizer step, instead of ending the run.

HF restarts training from step 0 with a smaller batch but the already-updated weights. For an error
in a window's forward or backward kiln instead drops the partial accumulation window (its gradients are zeroed; the optimizer has not stepped for
it, so nothing else needs rolling back), splits the same global window into smaller micro-batches
(half the size, twice the accumulation; see `smaller_micro_batch` for odd sizes), rebuilds the
train iterator at the same sample of the same epoch order, and redoes the step. The global batch,
the samples of every window and the step count stay the same, so the run continues as one
configured with the smaller micro-batch from the start would. Checkpoints written afterwards hold
the new sizes in their config.yaml, which a resumed run adopts.

Only single-process runs recover: under several processes the other ranks are already waiting in a
gradient collective that the failed rank will never join, so the error is reported instead. An
out-of-memory error anywhere else (inside the optimizer step, which may have updated some parameters
already, or in a callback) restarts training with a 10% smaller batch, as HF's Trainer does
(`batch_size.restart_smaller`).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from kiln.engine.data.epoch_rng import EpochRandomState
from kiln.engine.data.loaders import set_epoch, skip_batches
from kiln.engine.loop.batch_size import is_out_of_memory
from kiln.utils.errors import KilnError

log = logging.getLogger(__name__)
_NULL = nullcontext()


class WindowOutOfMemory(Exception):
    """An accumulation window ran out of memory before its optimizer step; its gradients are gone."""


def smaller_micro_batch(micro_batch: int, accumulation: int) -> int:
    """The micro-batch to retry with: the largest divisor of the window's samples (micro_batch x
    accumulation) that is at most half the micro-batch, so windows keep their exact samples — half of
    an even size; for an odd one a smaller divisor (9 x 1 -> 3 x 3, 7 x 1 -> 1 x 7)."""
    if micro_batch <= 1:
        raise KilnError(
            "auto_find_batch_size: out of memory during training with per_device_train_batch_size=1, which "
            "cannot be halved further; use a smaller model, gradient_checkpointing, lower precision, or shard "
            "the model (strategy: fsdp)."
        )
    window = micro_batch * accumulation
    return max(size for size in range(1, micro_batch // 2 + 1) if window % size == 0)


class OomRecovery:
    """Created per fit: `guard` wraps a window's micro-batches, `recover` rebuilds the data for the redo."""

    def __init__(self, loop: Any) -> None:  # the FitLoop (not imported: it imports this module)
        self.loop = loop
        # several processes: an OOM on one rank leaves the others in a collective (see the module docstring)
        self.enabled = bool(loop.config.data.auto_find_batch_size) and loop.strategy.world_size == 1

    def guard(self, model: Any) -> AbstractContextManager[None]:
        return self._guard(model) if self.enabled else _NULL

    @contextmanager
    def _guard(self, model: Any) -> Iterator[None]:
        loop = self.loop
        try:
            yield
        except Exception as err:  # noqa: BLE001 - anything but out-of-memory propagates unchanged
            if not is_out_of_memory(err):
                raise
            loop.run.micro_batch = None
            loop.strategy.zero_grad(model, loop.run.optimizer)  # the partial window's gradients
            raise WindowOutOfMemory(str(err)) from err

    def recover(self, epoch: int, seed: int) -> tuple[Iterable[Any], Iterator[Any]]:
        """Shrink the run's micro-batch (raising its accumulation) and return (loader, iterator at the
        failed window's first sample)."""
        loop = self.loop
        run, state = loop.run, loop.run.state
        size, k = run.micro_batch_size, run.accumulation
        new_size = smaller_micro_batch(size, k)
        new_k = size * k // new_size
        # windows before this one in the epoch were full, so the window starts at sample batches_into_epoch * size
        first_sample = state.batches_into_epoch * size
        gc.collect()  # the failed window's activations
        loop.strategy.accelerator.empty_cache()
        run.micro_batch_size, run.accumulation = new_size, new_k
        state.train_batch_size = new_size
        loader = loop.hooks.get_train_dataloader()
        if getattr(loader, "batch_size", new_size) != new_size:  # an override that ignores the setting
            raise KilnError(
                f"auto_find_batch_size: out of memory at step {state.global_step + 1}, but get_train_dataloader() "
                f"still returns batches of {loader.batch_size} after per_device_train_batch_size was set to "
                f"{new_size}; build the loader with the Trainer's `_train_batch_size` (HF's name for the run's live size)."
            )
        loop.checkpoints.attach(loop, loader)
        start = loop.epoch_rng.start
        loop.epoch_rng = EpochRandomState(loader)
        loop.epoch_rng.start = start  # the epoch began where it began: checkpoints keep saving that state
        set_epoch(loader, epoch, seed)
        state.batches_into_epoch = first_sample // new_size
        iterator, _ = skip_batches(loader, state.batches_into_epoch)
        log.warning(
            "Out of memory at step %d with per_device_train_batch_size=%d: redoing the step with "
            "per_device_train_batch_size=%d and gradient_accumulation_steps=%d (the same %d samples per step).",
            state.global_step + 1,
            size,
            new_size,
            new_k,
            size * k,
        )
        return loader, iterator
