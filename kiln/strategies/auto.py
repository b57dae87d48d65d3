"""`strategy: auto`: DDP when a launcher started several processes, otherwise one device."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.strategies import STRATEGIES
from kiln.strategies.environment import detect

if TYPE_CHECKING:
    from omegaconf import DictConfig


@STRATEGIES.register("auto")
class AutoStrategy:
    """Not a strategy itself: `resolve` returns the class to use."""

    @staticmethod
    def resolve(config: "DictConfig") -> type:
        if detect().distributed:
            return STRATEGIES.get("ddp")
        return STRATEGIES.get("single")
