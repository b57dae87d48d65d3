"""One process, one device: the CPU or a single CUDA device."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kiln.strategies import STRATEGIES
from kiln.strategies.base import SingleProcessCollectives, Strategy
from kiln.strategies.capabilities import Capabilities
from kiln.strategies.devices import resolve_device

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.precision.base import Precision


@STRATEGIES.register("single", "cpu", "cuda")
class SingleDeviceStrategy(SingleProcessCollectives, Strategy):
    name = "single"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        reasons={"mps": "Apple GPUs have their own strategy", "xla": "XLA devices have their own strategy"},
    )

    def __init__(self, config: DictConfig, precision: Precision) -> None:
        super().__init__(config, precision)
        requested = config.strategy.device
        if requested is None and config.strategy.name in ("cpu", "cuda"):
            requested = config.strategy.name
        self._device = resolve_device(requested)

    @property
    def root_device(self) -> torch.device:
        return self._device
