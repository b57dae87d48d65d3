"""Resuming from a checkpoint: the other half of kiln.engine.checkpoint.manager.

The model and optimizer go through the run's CheckpointIO, or, for a checkpoint of another format, through
the format registry's translation (kiln.strategies.format_translation); the engine's own files (schedule,
precision, trainer state, loop position, callback state, per-rank RNG and loop state) are read here, the
same for every format. Everything is read with `weights_only=True`, safetensors or JSON. Functions of the
run's CheckpointManager (`manager`), as kiln.engine.checkpoint.hf_checkpoint's are."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from kiln.engine.callbacks.state import TrainerState
from kiln.engine.checkpoint.files import LOOP, RNG, STATE, is_hf_checkpoint, read_marker
from kiln.engine.checkpoint.hf_checkpoint import compare_with_checkpoint, load_hf_checkpoint
from kiln.engine.checkpoint.restored import Restored
from kiln.engine.checkpoint.run_state import load_callback_state, load_position, load_scheduler
from kiln.engine.checkpoint.saved_config import changed_settings
from kiln.engine.model.peft import checkpoint_io_for
from kiln.strategies.format_translation import resuming_io
from kiln.utils.errors import CheckpointError, safe_torch_load

log = logging.getLogger(__name__)

#: config keys whose change makes the saved data position mean something else (warned about on resume)
POSITION_KEYS = (
    "data.per_device_train_batch_size",
    "train.gradient_accumulation_steps",
    "seed",
    "data_seed",
    "data.dataloader_drop_last",
    "data.group_by_length",
)


def load_checkpoint(manager: Any, path: str) -> Restored:
    """Load the weights, optimizer, schedule and precision state of `path` into the (already set-up)
    run; return the trainer state and what the loop applies later (see Restored)."""
    if is_hf_checkpoint(path):  # written by HF's Trainer: restore what it holds, say what it does not
        return load_hf_checkpoint(manager, path)
    strategy, run = manager.strategy, manager.run
    meta = read_marker(path)
    if not meta.get("resumable", True):
        raise CheckpointError(
            f"{path} was saved with save_only_model=true and cannot be resumed; load its weights instead."
        )
    # a PeftModel: its adapter only (HF); a checkpoint of another format: translated, or refused in one sentence
    io = resuming_io(checkpoint_io_for(strategy, run.model), meta.get("format", "full"), path)
    saved_world = meta.get("world_size")
    if saved_world != strategy.world_size and not io.reshardable:
        raise CheckpointError(
            f"{path} holds shards for {saved_world} processes but this run has {strategy.world_size}; "
            f"the {io.format!r} format cannot be resharded: resume with {saved_world} processes."
        )
    check_data_shards(path, meta, strategy.world_size, strategy.data_shards)
    _check_config(manager, path)
    assert run.wrapped is not None  # Run.__post_init__ sets it, and nothing sets it back to None
    io.load(path, model=run.wrapped, module=run.model, optimizer=run.optimizer)
    load_scheduler(manager, path, "was scheduler.name changed?")
    prec = os.path.join(path, "precision.pt")
    if os.path.exists(prec):
        manager.precision.load_state_dict(safe_torch_load(prec))
    try:
        state = TrainerState.load_from_json(os.path.join(path, STATE))
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"{path}/{STATE} is unreadable ({err}).") from None
    compare_with_checkpoint(state, manager, path)  # HF's warning: logging/eval/save steps or batch size changed
    load_position(path, state)
    load_callback_state(manager, path, state)  # early-stopping counters, ...: part of exact resume
    rank = strategy.global_rank
    rng_file = os.path.join(path, RNG.format(rank=rank))
    rng = safe_torch_load(rng_file) if os.path.exists(rng_file) else None
    if rng is None:
        warnings.warn(
            f"{rng_file} is missing: random streams are not restored, results will differ from an uninterrupted run.",
            stacklevel=3,
        )
    loop_file = os.path.join(path, LOOP.format(rank=rank))
    loop = safe_torch_load(loop_file) if os.path.exists(loop_file) else {}
    log.info(
        "Resuming from %s: step %d, epoch %d, %d batches into the epoch.",
        path,
        state.global_step,
        state.epoch_index,
        state.batches_into_epoch,
    )
    return Restored(state, rng, loop.get("loop"), loop.get("dataset"))


def check_data_shards(path: str, meta: dict[str, Any], world: int, shards: int) -> None:
    """Warn when the number of data-parallel ranks (the train sampler's replicas, `shards` now) changed: that,
    not the process count (`world`), moves each rank's data position (a pipeline's or tensor-parallel
    group's ranks read one shard together). Markers of kiln versions before `data_shards` only say the
    process count."""
    saved_world = meta.get("world_size")
    saved = meta.get("data_shards", saved_world)
    if saved != shards:
        warnings.warn(
            f"{path} was saved by {saved_world} processes and this run has {world} ({saved} and {shards} reading "
            "distinct batches): weights, optimizer and schedule are restored, but each rank's data position and "
            "random streams cannot be, so the run will not match an uninterrupted one.",
            stacklevel=4,
        )


def _check_config(manager: Any, path: str) -> None:
    """Warn when a setting that decides the data position changed since the checkpoint. The saved
    config.yaml is data: read without resolving anything, compared as text (saved_config)."""
    if moved := changed_settings(path, manager.saved_tree(), POSITION_KEYS):
        warnings.warn(
            f"Resuming {path} with changed settings ({'; '.join(moved)}): the data position saved in the "
            "checkpoint no longer points at the same samples, so the run will not match an uninterrupted one.",
            stacklevel=4,
        )
