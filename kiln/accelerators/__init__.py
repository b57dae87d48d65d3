"""Accelerators, one file per device kind (cpu, cuda, mps, xla): device choice, RNG streams, memory
counters, cache, pin-memory default and dtype support. Strategies pick one for their device; seeding,
checkpoint RNG state and memory metrics go through them, so nothing above this layer asks
`torch.cuda` directly. Files are imported on first lookup (torch_xla only when XLA is used)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.registry import Registry

if TYPE_CHECKING:
    import torch

    from kiln.accelerators.base import Accelerator

ACCELERATORS: Registry[type[Accelerator]] = Registry("accelerator", "strategy.device")

for _name, _module in (
    ("cpu", "kiln.accelerators.cpu"),
    ("cuda", "kiln.accelerators.cuda"),
    ("mps", "kiln.accelerators.mps"),
    ("xla", "kiln.accelerators.xla"),
):
    ACCELERATORS.add_lazy(_name, _module)

#: the order in which `auto` looks for a device, and in which RNG streams are captured
SEARCH_ORDER = ("cuda", "mps", "xla")


def accelerator_for(device: torch.device | str) -> Accelerator:
    """The accelerator of a device (`cuda:1` -> the CUDA accelerator)."""
    import torch

    kind = torch.device(device).type
    return ACCELERATORS.get(kind)()


def available_accelerators() -> list[Accelerator]:
    """Every non-CPU accelerator usable in this process (without importing torch_xla unless it is
    already imported: an XLA run imports it first)."""
    found = []
    for name in SEARCH_ORDER:
        cls = ACCELERATORS.get(name)
        if cls.is_available():
            found.append(cls())
    return found
