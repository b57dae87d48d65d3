"""HF's `torch_empty_cache_steps`: release the accelerator's cached memory every N optimizer steps
(slower, but it can avoid fragmentation out-of-memory errors)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.engine.callbacks.base import Callback


def device_empty_cache(device: torch.device) -> Callable[[], None]:
    """`torch.<device type>.empty_cache` (cuda, mps, xpu, ...); nothing to release on the CPU."""
    module = getattr(torch, device.type, None)
    return getattr(module, "empty_cache", None) or (lambda: None)


class EmptyCacheCallback(Callback):
    def __init__(self, every: int, empty_cache: Callable[[], None]) -> None:
        self.every = every
        self.empty_cache = empty_cache

    def on_step_end(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step % self.every == 0:
            self.empty_cache()
