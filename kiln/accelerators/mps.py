"""Apple-silicon GPUs through Metal (`torch.mps`). `is_available` is a function of this module so
that tests on machines without MPS can inject the probe; nothing here has run on Apple hardware in
kiln's CI (see docs/strategies.md)."""

from __future__ import annotations

from typing import Any

import torch

from kiln.accelerators import ACCELERATORS
from kiln.accelerators.base import Accelerator


def mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def mps_supports_bf16() -> bool:
    """bf16 on MPS needs macOS 14 (Sonoma) or newer; torch answers by trying."""
    try:
        torch.zeros(1, dtype=torch.bfloat16, device="mps")
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


@ACCELERATORS.register("mps")
class MPSAccelerator(Accelerator):
    name = "mps"

    @classmethod
    def is_available(cls) -> bool:
        from kiln.accelerators import mps

        return mps.mps_available()

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("mps")

    def manual_seed(self, seed: int) -> None:
        torch.mps.manual_seed(seed)

    def rng_state(self) -> Any:
        return torch.mps.get_rng_state()

    def set_rng_state(self, state: Any) -> None:
        torch.mps.set_rng_state(state)

    def empty_cache(self) -> None:
        torch.mps.empty_cache()

    def has_memory_stats(self) -> bool:
        return True

    def memory_allocated(self) -> int:
        return int(torch.mps.current_allocated_memory())

    def max_memory_allocated(self) -> int:
        # torch.mps keeps no peak counter; the driver's total is the closest upper bound
        return int(torch.mps.driver_allocated_memory())

    def dtype_unsupported(self, dtype: torch.dtype, device: torch.device) -> str | None:
        from kiln.accelerators import mps

        if dtype is torch.bfloat16 and not mps.mps_supports_bf16():
            return "bf16 on MPS needs macOS 14 or newer"
        return None
