"""The "***** Running training *****" block HF's Trainer logs when training starts, line for line, so
scripts and habits that read it keep working: examples, epochs, batch sizes, accumulation, total
optimization steps, trainable parameters, and where a resumed run picks up.

Logged at INFO by kiln's logger, on the process that logs at the main level (global rank 0, or each
node's local rank 0 with `log.on_each_node`, as HF's `should_log`); `log.level: info` shows it."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from torch import nn

from kiln.engine.distributed import should_log

log = logging.getLogger(__name__)


def trainable_parameters(model: nn.Module) -> int:
    """HF's `get_model_param_count(model, trainable_only=True)`; ZeRO-3 keeps a partitioned
    parameter's full size in `ds_numel` (the module holds an empty tensor)."""
    return sum(int(getattr(p, "ds_numel", 0) or p.numel()) for p in model.parameters() if p.requires_grad)


def num_examples(
    loader: Iterable[Any], batches_per_epoch: int | None, micro_batch_size: int, total_batch: int, max_steps: int
) -> int:
    """HF's `num_examples`: the dataset's length; the loader's batches times the batch size when the
    dataset has none; for a loader without a length, the samples `max_steps` steps read."""
    if batches_per_epoch is None:
        return total_batch * max_steps
    try:
        return len(loader.dataset)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        return batches_per_epoch * micro_batch_size


def log_training_start(
    loop: Any,
    loader: Iterable[Any],
    batches_per_epoch: int | None,
    max_steps: int,
    num_epochs: int,
    updates_per_epoch: int,
    resume_path: str | None,
) -> None:
    """Log HF's training summary for the fit `loop` is about to run (after a resume's state is loaded)."""
    cfg, run, strategy = loop.config, loop.run, loop.strategy
    if not log.isEnabledFor(logging.INFO) or not should_log(cfg, strategy):
        return
    configured = int(cfg.data.per_device_train_batch_size)
    total = run.micro_batch_size * run.accumulation * strategy.data_shards
    lines = [
        "***** Running training *****",
        f"  Num examples = {num_examples(loader, batches_per_epoch, configured, total, max_steps):,}",
        f"  Num Epochs = {num_epochs:,}",
        f"  Num update steps per epoch = {updates_per_epoch:,}",
        f"  Instantaneous batch size per device = {configured:,}",
    ]
    if run.micro_batch_size != configured:  # HF's line says DataParallel; here auto_find_batch_size changed it
        lines.append(f"  Batch size per device adjusted by auto_find_batch_size to: {run.micro_batch_size:,}")
    lines += [
        f"  Total train batch size (w. parallel, distributed & accumulation) = {total:,}",
        f"  Gradient Accumulation steps = {run.accumulation}",
        f"  Total optimization steps = {max_steps:,}",
        f"  Number of trainable parameters = {trainable_parameters(run.model):,}",
    ]
    state = loop.run.state
    if resume_path is not None:
        lines.append(
            f"  Resuming training from checkpoint with epoch {state.epoch_index} and global step {state.global_step}"
        )
        if not cfg.train.ignore_data_skip:
            lines.append(
                f"  Fast-forwarding the dataloader past {state.epoch_index} epochs and {state.batches_into_epoch} "
                "batches to resume from the exact training state."
            )
    for line in lines:  # one record per line, as HF logs them
        log.info(line)
