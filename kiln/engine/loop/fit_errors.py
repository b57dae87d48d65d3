"""How a fit that fails leaves `fit()` (`fit_errors`, around the fit loop): the error a user should see instead of the one the loop raised (a
peer's Ctrl-C that broke this rank's collective, an out-of-memory error after `auto_find_batch_size`), and
the one sentence a Ctrl-C becomes; and (`stopping_peers`, around the whole of `fit()`) how the other ranks
learn of it: unless every rank's fit failed, the strategy aborts the process group, so that they stop
within a grace period instead of waiting in a collective until its timeout, even when the script catches
the error and lives on."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

from kiln.engine.loop.batch_size import is_out_of_memory
from kiln.utils.errors import KilnError, RankFailed, TrainingInterrupted

if TYPE_CHECKING:
    from kiln.engine.run import Run
    from kiln.strategies.base import Strategy


#: this process's fit() calls so far: the ranks call fit() alike, so the n-th call is the same fit on every
#: rank, and its failures are counted under its own key (kiln/strategies/abort.py)
_FIT_CALLS = [0]


@contextmanager
def stopping_peers(strategy: Strategy) -> Iterator[None]:
    """Around the whole of `fit()`: when it raises an Exception on this rank, `strategy.fit_failed` (after
    `fit_errors` let a save in flight land) agrees with the other ranks: when every rank's fit raised, nothing
    is aborted and the group stays for a later fit; otherwise, after a grace period for the others to fail
    too (`kiln.strategies.abort.GRACE_S`), it aborts the process group, so that a peer's pending or next
    collective fails now rather than at the collective timeout. The script sees its own exception
    unchanged; a peer whose collective broke on the abort raises `RankFailed`, naming the rank that aborted
    and its error. A Ctrl-C (KeyboardInterrupt, TrainingInterrupted) and a preemption (which ends fit
    normally) abort nothing: every rank is stopping already. With one process there is nothing to abort.
    After an abort the group cannot be used again in this process, so a later `fit()` says so."""
    if strategy.aborted:
        raise KilnError(
            "fit() cannot run again in this process: an earlier fit() failed and aborted the process group to "
            "stop the other ranks; start the job again (resume_from_checkpoint picks up its last checkpoint)."
        )
    fit_call = _FIT_CALLS[0]
    _FIT_CALLS[0] += 1
    try:
        yield
    except Exception as err:
        first = strategy.fit_failed(err, fit_call)
        if first is not None and isinstance(err, RuntimeError) and not isinstance(err, KilnError):
            raise RankFailed(
                f"rank {first['rank']} failed with {first['error']}; this rank's collective broke when that rank "
                "aborted the process group to stop the job. Look at that rank's output for the cause."
            ) from err
        raise


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
