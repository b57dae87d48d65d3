"""What loading a checkpoint hands back to the fit loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.engine.callbacks.state import TrainerState


@dataclass
class Restored:
    """What a checkpoint hands back beyond the weights, optimizer and schedule it loads in place: the
    trainer state, and per rank what the fit loop applies at its own moment (the RNG streams right
    before the first resumed batch, the running loss sums, an iterable dataset's position)."""

    state: TrainerState
    rng: dict[str, Any] | None = None
    loop: dict[str, Any] | None = None
    dataset: dict[str, Any] | None = None
