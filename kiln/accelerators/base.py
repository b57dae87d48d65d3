"""The Accelerator interface: what differs between device kinds, below any strategy.

Every method is safe to call on a machine without the device (`is_available()` says whether it
is there); the defaults describe a device with no RNG, memory counters or cache of its own."""

from __future__ import annotations

from typing import Any, ClassVar

import torch


class Accelerator:
    name: ClassVar[str] = "base"
    #: whether DataLoader memory pinning helps (host -> device copies); HF's dataloader_pin_memory
    #: is honoured only where it does
    pin_memory: ClassVar[bool] = False

    @classmethod
    def is_available(cls) -> bool:
        return False

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.name) if index is None else torch.device(self.name, index)

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    # -- random streams ----------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        """Seed every device of this kind."""

    def rng_state(self) -> Any:
        """This kind's RNG streams as plain tensors/lists (None: it has none of its own)."""
        return None

    def set_rng_state(self, state: Any) -> None:
        """Restore what `rng_state` returned (a resume on fewer devices restores those it has)."""

    # -- memory ------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        """Return cached blocks to the device (after an out-of-memory probe)."""

    def has_memory_stats(self) -> bool:
        return False

    def memory_allocated(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak window."""

    # -- debugging ---------------------------------------------------------------------------
    def metrics_report(self) -> str | None:
        """The device runtime's own counters as text (XLA: compilations, transfers), for
        `debug: tpu_metrics_debug`; None where the device keeps none."""
        return None

    def device_name(self, device: torch.device) -> str | None:
        """The product name of `device` (for its peak FLOP/s in kiln.accelerators.peaks); None where the
        device has no table entry to look up (CPU)."""
        return None

    # -- numerics ----------------------------------------------------------------------------
    def dtype_unsupported(self, dtype: torch.dtype, device: torch.device) -> str | None:
        """None if the device computes in `dtype`, else the reason it does not (one clause)."""
        return None
