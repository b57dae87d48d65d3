"""One process, one device: the CPU or a single CUDA device."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kiln.strategies import STRATEGIES
from kiln.strategies.base import Strategy

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.precision.base import Precision


def default_device(requested: str | None) -> torch.device:
    if requested:
        device = torch.device(requested)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                f"strategy.device is {requested!r} but CUDA is not available on this machine; use strategy.device=cpu."
            )
        return device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@STRATEGIES.register("single", "cpu", "cuda")
class SingleDeviceStrategy(Strategy):
    name = "single"

    def __init__(self, config: "DictConfig", precision: "Precision") -> None:
        super().__init__(config, precision)
        requested = config.strategy.device
        if requested is None and config.strategy.name in ("cpu", "cuda"):
            requested = config.strategy.name
        self._device = default_device(requested)

    @property
    def root_device(self) -> torch.device:
        return self._device
