"""The engine's own state in a checkpoint, read back on resume from kiln's checkpoints
(kiln.engine.checkpoint.loading) and HF's (kiln.engine.checkpoint.hf_checkpoint) alike: the schedule,
the callbacks' state and the loop position. Functions of the run's CheckpointManager (`manager`)."""

from __future__ import annotations

import json
import logging
import os
import warnings
from typing import Any

from kiln.engine.callbacks.state import TrainerState
from kiln.engine.checkpoint.files import POSITION
from kiln.utils.errors import CheckpointError, safe_torch_load
from kiln.utils.hf_logging import hf_logger
from kiln.utils.param_groups import regroup_scheduler_state

log = logging.getLogger(__name__)


def load_scheduler(manager: Any, path: str, hint: str) -> bool:
    """The schedule's state from `path/scheduler.pt` (in either param-group layout); False when absent."""
    run = manager.run
    sched = os.path.join(path, "scheduler.pt")
    if run.scheduler is None:
        return False
    if not os.path.exists(sched):
        warnings.warn(f"{sched} is missing: the learning-rate schedule restarts from its beginning.", stacklevel=3)
        return False
    try:
        saved = safe_torch_load(sched)
        if run.optimizer is not None:  # saved in the other param-group layout (kiln.utils.param_groups)
            saved = regroup_scheduler_state(saved, len(run.optimizer.param_groups))
        run.scheduler.load_state_dict(saved)
    except (KeyError, ValueError, TypeError, AttributeError) as err:
        raise CheckpointError(
            f"{sched} does not fit this run's scheduler {type(run.scheduler).__name__} ({err}); {hint}"
        ) from None
    return True


def load_callback_state(manager: Any, path: str, state: TrainerState) -> bool:
    """Give each callback its saved state; warn about state no callback of this run takes."""
    callbacks = {k: v for k, v in (state.stateful_callbacks or {}).items() if k != "TrainerControl"}  # HF's; not kept
    missing = manager.callbacks.load_state_dict(
        callbacks, restore_args=bool(manager.config.save.restore_callback_states_from_checkpoint)
    )
    if missing:  # HF's _load_callback_state's warning, on its logger
        hf_logger("transformers.trainer", log).warning(
            f"Checkpoint included callbacks not included in current configuration. Ignoring. ({', '.join(missing)}: "
            f"{path} holds their state, and this run has no such callback)"
        )
    return bool(callbacks)


def load_position(path: str, state: TrainerState) -> None:
    """The loop position from its own file; checkpoints of older kiln versions kept it inside
    trainer_state.json, which `TrainerState.load_from_json` has already read."""
    file = os.path.join(path, POSITION)
    if not os.path.exists(file):
        return
    try:
        with open(file, encoding="utf-8") as fh:
            state.set_loop_position(json.load(fh))
    except (OSError, ValueError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{file} is unreadable ({err}).") from None
