"""How a fit that fails leaves `fit()`: the error a user should see instead of the one the loop raised (a
peer's Ctrl-C that broke this rank's collective, an out-of-memory error after `auto_find_batch_size`), and
the one sentence a Ctrl-C becomes."""

from __future__ import annotations

import os
from typing import Any, NoReturn

from kiln.engine.loop.batch_size import is_out_of_memory
from kiln.utils.errors import KilnError, TrainingInterrupted


def raise_translated(err: Exception, config: Any, micro_batch_size: int) -> None:
    """Raise what `fit()` raises instead of `err`; return when `err` itself is the error to raise."""
    from kiln.launch.worker import peer_interrupted

    if isinstance(err, RuntimeError) and peer_interrupted():  # a peer's Ctrl-C broke this rank's collective
        raise KeyboardInterrupt from None
    if config.data.auto_find_batch_size and is_out_of_memory(err):
        raise KilnError(
            f"Out of memory during training with per_device_train_batch_size={micro_batch_size}, "
            "which auto_find_batch_size found to fit the first step (a later batch can be longer): resume "
            "from the last checkpoint or restart with a smaller per_device_train_batch_size."
        ) from err


def raise_interrupted(output_dir: str, global_step: int) -> NoReturn:
    """Ctrl-C during fit(): one sentence, the step it stopped at and the last checkpoint to resume from."""
    from kiln.engine.checkpoint.files import latest_checkpoint

    last = latest_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    raise TrainingInterrupted(f"interrupted at step {global_step}; last checkpoint: {last or 'none'}") from None
