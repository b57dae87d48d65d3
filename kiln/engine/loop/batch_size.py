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
(and accumulation) its checkpoint was trained with instead of searching. An out-of-memory error
later in training is handled by `oom_recovery`.
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Any, Iterable

import torch

from kiln.utils.errors import KilnError
from kiln.engine.seed import rng_state, set_rng_state


log = logging.getLogger(__name__)

_OOM_MESSAGES = (" out of memory", "MPS backend out of memory", "CUDNN_STATUS_NOT_SUPPORTED",
                 "DefaultCPUAllocator: can't allocate memory", "PT_DEVMEM Allocation failed")


def is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, KilnError):  # kiln's own explanations mention memory too
        return False
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and len(err.args) == 1 and any(m in str(err.args[0]) for m in _OOM_MESSAGES)


def saved_batch_size(checkpoint: str) -> tuple[int, int] | None:
    """The (per-device batch size, gradient accumulation steps) a checkpoint was trained with (its
    config.yaml): the accumulation too, since an out-of-memory error during training may have changed both."""
    from omegaconf import OmegaConf

    from kiln.engine.checkpoint.manager import CONFIG

    path = os.path.join(checkpoint, CONFIG)
    if not os.path.exists(path):
        return None
    saved = OmegaConf.load(path)
    size, k = OmegaConf.select(saved, "data.per_device_train_batch_size"), OmegaConf.select(saved, "train.gradient_accumulation_steps")
    return (int(size), int(k)) if size is not None and k is not None else None


def find_batch_size(loop: Any) -> Iterable[Any]:  # the FitLoop (not imported: it imports this module)
    """Set the run's micro-batch size to the largest (from the configured one down) whose first
    accumulation window and optimizer step fit in memory; returns the train dataloader for it."""
    from kiln.engine.run import setup_for_training

    run, hooks, strategy = loop.run, loop.hooks, loop.strategy
    if isinstance(hooks.train_dataset, torch.utils.data.DataLoader):
        raise KilnError("auto_find_batch_size needs kiln to build the train dataloader: a DataLoader passed as "
                        "train_dataset has a fixed batch size. Pass the dataset instead.")
    setup_for_training(run, strategy, loop.precision, loop.config, hooks.create_optimizer, hooks.create_scheduler, None)
    size = run.micro_batch_size
    saved = rng_state()
    while True:
        loader = hooks.get_train_dataloader()
        failed = _attempt(loop, loader)
        set_rng_state(saved)  # the attempt drew dropout masks and the loader's seed
        if strategy.world_size > 1:
            failed = bool(strategy.reduce(torch.tensor(float(failed), device=strategy.root_device), "max") > 0)
        if not failed:
            return loader
        if size == 1:
            raise KilnError("auto_find_batch_size: even per_device_train_batch_size=1 runs out of memory; use a smaller "
                            "model, gradient_checkpointing, lower precision, or shard the model (strategy: fsdp).")
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
