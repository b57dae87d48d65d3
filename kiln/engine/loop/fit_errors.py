"""How a fit that fails leaves `fit()` (`fit_errors`, around the fit loop): the error a user should see instead of the one the loop raised (a
peer's Ctrl-C that broke this rank's collective, an out-of-memory error after `auto_find_batch_size`), and
the one sentence a Ctrl-C becomes."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

from kiln.engine.loop.batch_size import is_out_of_memory
from kiln.utils.errors import KilnError, TrainingInterrupted

if TYPE_CHECKING:
    from kiln.engine.run import Run


@contextmanager
def fit_errors(config: Any, run: Run) -> Iterator[None]:
    """Around the fit loop: an error leaves as `raise_translated` says, a Ctrl-C as one sentence
    (`raise_interrupted`), and however it ends, a save in flight (save.async_save) still lands and the
    loggers are flushed (an exception skips on_train_end)."""
    try:  # the outer try: a Ctrl-C that lands while an error is being handled is still the interrupt
        try:
            yield
        except Exception as err:
            raise_translated(err, config, run.micro_batch_size)  # a peer's Ctrl-C; out of memory, explained
            raise
        finally:
            run.checkpoints.drain()
            from kiln.loggers.writer import flush_after_fit

            flush_after_fit(sys.exc_info()[1])
    except KeyboardInterrupt:
        raise_interrupted(config.output_dir, run.state.global_step)


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
