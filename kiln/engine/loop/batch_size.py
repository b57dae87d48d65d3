"""`auto_find_batch_size` (HF): before training, shrink the per-device batch until a step fits.

Each attempt runs one real accumulation window at the candidate size: forward and backward of every
micro-batch, then an optimizer step with the learning rate at 0 and zeroed gradients, which
allocates the optimizer state (Adam's moments are often what runs out of memory at step 1) without
changing a weight. Afterwards the gradients, the optimizer state and every RNG stream are put back,
so training starts exactly as if the found size had been configured. On out-of-memory the size
decays by 10% (accelerate's `find_executable_batch_size`, which HF uses).

The attempt runs on the strategy's `probe_module` (for DDP the unwrapped module: no gradient
all-reduce, so a rank that runs out of memory cannot leave another waiting in a collective) and one
all-reduce per attempt makes every rank agree. Strategies that cannot probe this way declare it in
their capabilities, and the combination is refused before training. A resumed run takes the size
(and accumulation) its checkpoint was trained with instead of searching.

Later in training, an out-of-memory error in a window's forward or backward is redone in place with
smaller micro-batches (`oom_recovery`). One raised anywhere else (the optimizer step, a callback's
`on_step_end`, logging, saving) restarts training the way HF's Trainer does (`restart_smaller`): HF
wraps its whole inner training loop in `find_executable_batch_size`, so the loop starts again at
step 0 with the batch size times 0.9, from the weights and optimizer state the failed attempt left,
with a new schedule and a new `TrainerState`. An out-of-memory error in evaluation is reported
instead (`evaluation_out_of_memory`): restarting with a smaller *training* batch cannot fix it.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kiln.engine.callbacks.state import TrainerState
from kiln.engine.seed import rng_state, set_rng_state
from kiln.utils.errors import KilnError

log = logging.getLogger(__name__)

_OOM_MESSAGES = (
    " out of memory",
    "MPS backend out of memory",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "DefaultCPUAllocator: can't allocate memory",
    "PT_DEVMEM Allocation failed",
)


def is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, KilnError):  # kiln's own explanations mention memory too
        return False
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and len(err.args) == 1 and any(m in str(err.args[0]) for m in _OOM_MESSAGES)


def saved_batch_size(checkpoint: str) -> tuple[int, int] | None:
    """The (per-device batch size, gradient accumulation steps) a checkpoint was trained with (its
    config.yaml, read as data: nothing in it is resolved): the accumulation too, since an out-of-memory
    error during training may have changed both."""
    from kiln.engine.checkpoint.saved_config import read_saved_config, select

    saved = read_saved_config(checkpoint)
    size, k = select(saved, "data.per_device_train_batch_size"), select(saved, "train.gradient_accumulation_steps")
    return (size, k) if type(size) is int and type(k) is int else None


def find_batch_size(loop: Any) -> Iterable[Any]:  # the FitLoop (not imported: it imports this module)
    """Set the run's micro-batch size to the largest (from the configured one down) whose first
    accumulation window and optimizer step fit in memory; returns the train dataloader for it."""
    from kiln.engine.run import setup_for_training

    run, hooks, strategy = loop.run, loop.hooks, loop.strategy
    if isinstance(hooks.train_dataset, torch.utils.data.DataLoader):
        raise KilnError(
            "auto_find_batch_size needs kiln to build the train dataloader: a DataLoader passed as "
            "train_dataset has a fixed batch size. Pass the dataset instead."
        )
    setup_for_training(run, strategy, loop.precision, loop.config, hooks.create_optimizer, hooks.create_scheduler, None)
    size = run.micro_batch_size
    saved = rng_state()
    while True:
        loader: Iterable[Any] = hooks.get_train_dataloader()
        failed = _attempt(loop, loader)
        set_rng_state(saved)  # the attempt drew dropout masks and the loader's seed
        if strategy.world_size > 1:
            failed = bool(strategy.reduce(torch.tensor(float(failed), device=strategy.root_device), "max") > 0)
        if not failed:
            return loader
        if size == 1:
            raise KilnError(
                "auto_find_batch_size: even per_device_train_batch_size=1 runs out of memory; use a smaller "
                "model, gradient_checkpointing, lower precision, or shard the model (strategy: fsdp)."
            )
        new = max(1, int(size * 0.9))
        log.warning("auto_find_batch_size: per_device_train_batch_size=%d ran out of memory; trying %d.", size, new)
        size = run.micro_batch_size = new


def _attempt(loop: Any, loader: Iterable[Any]) -> bool:
    """One window at the loader's batch size; True if it ran out of memory. Leaves no gradients,
    no optimizer state and unchanged weights behind."""
    strategy, opt = loop.strategy, loop.run.optimizer
    assert opt is not None
    module = strategy.probe_module(loop.run.wrapped)
    iterator = iter(loader)
    window = [b for _, b in zip(range(loop.run.accumulation), iterator)]
    del iterator  # stops dataloader workers
    lrs = [group["lr"] for group in opt.param_groups]
    try:
        for batch in window:
            loop.hooks.training_step(module, strategy.batch_to_device(batch))
        for group in opt.param_groups:  # a step that allocates the optimizer state and moves nothing
            group["lr"] = 0.0
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.zero_()
        opt.step()
        return False
    except Exception as err:  # noqa: BLE001 - anything but out-of-memory is re-raised
        if not is_out_of_memory(err):
            raise
        return True
    finally:
        for group, lr in zip(opt.param_groups, lrs):
            group["lr"] = lr
        opt.state.clear()
        opt.zero_grad(set_to_none=True)
        del window
        gc.collect()
        strategy.accelerator.empty_cache()


def restart_smaller(loop: Any, err: BaseException, resume_path: str | None) -> bool:
    """After an out-of-memory error escaped a fit (`loop._run`), set the loop up to train again from
    step 0 with `int(size * 0.9)` (HF's `find_executable_batch_size` around `_inner_training_loop`) and
    return True; return False where this does not apply and the caller re-raises `err`.

    What carries over is what HF keeps: the model's current weights, the optimizer and its state,
    the callbacks (and their counters), the live gradient accumulation. What starts again: the step
    count and the rest of the `TrainerState`, a schedule kiln built (HF builds it again), the data
    from the epoch's start. Only one process restarts (several would have to agree first, and a rank
    waiting in a collective never hears of the error), and only a run that did not resume (its
    data position counts in the checkpoint's batch size); those report the error instead."""
    if not (loop.config.data.auto_find_batch_size and is_out_of_memory(err)):
        return False
    if loop.strategy.world_size > 1 or resume_path is not None:
        return False
    run, strategy = loop.run, loop.strategy
    size = run.micro_batch_size
    new = int(size * 0.9)
    if new < 1:
        raise KilnError(
            "auto_find_batch_size: out of memory during training even with per_device_train_batch_size=1; "
            "use a smaller model, gradient_checkpointing, lower precision, or shard the model "
            "(strategy: fsdp)."
        ) from err
    old = run.state
    log.warning(
        "auto_find_batch_size: out of memory with per_device_train_batch_size=%d after %d optimizer steps, outside "
        "a window's forward and backward; training restarts from step 0 with per_device_train_batch_size=%d (as "
        "HF's Trainer does), from the current weights and optimizer state.",
        size,
        old.global_step,
        new,
    )
    if run.optimizer is not None:  # an optimizer step that failed half-way leaves gradients behind
        strategy.zero_grad(run.wrapped, run.optimizer)
    run.micro_batch, run.micro_batch_size = None, new
    if run.created_scheduler:  # HF's `_prepare_for_training` drops the schedule it built; setup builds it again
        run.scheduler = None
    run.state = TrainerState(
        is_world_process_zero=old.is_world_process_zero,
        is_local_process_zero=old.is_local_process_zero,
        is_hyper_param_search=old.is_hyper_param_search,
        trial_name=old.trial_name,
        trial_params=old.trial_params,
    )
    # the control stays, as in HF: on_train_begin, on_epoch_begin and on_step_begin clear its flags
    loop.checkpoints.saved_step = None  # no checkpoint of the new attempt yet (a preemption save checks it)
    loop.restarted = True  # the size is chosen: no probe before the next attempt (HF has none either)
    return True


def free_memory(strategy: Any) -> None:
    """Collect what a failed attempt left (once its error, and the frames holding tensors, are gone)."""
    gc.collect()
    strategy.accelerator.empty_cache()


@contextmanager
def evaluation_out_of_memory(enabled: bool) -> Iterator[None]:
    """An out-of-memory error in an evaluation during training becomes one that no batch-size search
    retries (HF's `_evaluate` does the same): a smaller training batch cannot make evaluation fit."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - anything but out-of-memory propagates unchanged
        if enabled and is_out_of_memory(err):
            raise KilnError(
                "Evaluation ran out of memory; auto_find_batch_size only adjusts the training batch size: "
                "lower per_device_eval_batch_size (or set eval_accumulation_steps)."
            ) from err
        raise
