"""The step plan of a fit: how many optimizer steps, epochs and steps per epoch (HF's rules)."""

from __future__ import annotations

import math
import sys
from typing import Any


def plan_steps(cfg: Any, k: int, batches_per_epoch: int | None) -> tuple[int, int, int]:
    """(max_steps, num_epochs, updates_per_epoch) exactly as HF defines them.

    An epoch of b micro-batches gives ceil(b / k) optimizer steps (k: the run's accumulation): the
    last, shorter window is stepped too. `max_steps > 0` overrides epochs; fractional epochs round the step count up."""
    if batches_per_epoch is None:
        if cfg.train.max_steps <= 0:
            raise ValueError(
                "The training data has no length (an iterable dataset), so the number of steps cannot be derived "
                "from num_train_epochs: set train.max_steps (max_steps) to a positive number."
            )
        return cfg.train.max_steps, sys.maxsize, cfg.train.max_steps
    if batches_per_epoch == 0:
        raise ValueError("The training dataloader is empty: check train_dataset and the batch size (drop_last?).")
    per_epoch = max(math.ceil(batches_per_epoch / k), 1)
    if cfg.train.max_steps > 0:
        max_steps = cfg.train.max_steps
        return max_steps, math.ceil(max_steps / per_epoch), per_epoch
    max_steps = math.ceil(cfg.train.num_train_epochs * per_epoch)
    return max_steps, math.ceil(cfg.train.num_train_epochs), per_epoch
