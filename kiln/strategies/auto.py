"""`strategy: auto`: DDP when a launcher started several processes, the Apple GPU on a Mac that has
one, otherwise one device (a CUDA GPU if present, else the CPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.launch.environment import detect
from kiln.strategies import STRATEGIES

if TYPE_CHECKING:
    from omegaconf import DictConfig


@STRATEGIES.register("auto")
class AutoStrategy:
    """Not a strategy itself: `resolve` returns the class to use."""

    @staticmethod
    def resolve(config: DictConfig) -> type:
        if detect().distributed:
            return STRATEGIES.get("ddp")
        from kiln.accelerators import ACCELERATORS

        if config.strategy.device is None and ACCELERATORS.get("mps").is_available():
            return STRATEGIES.get("mps")
        return STRATEGIES.get("single")
