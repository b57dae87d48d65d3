"""XLA devices (TPU, or CPU/GPU through PJRT) via torch_xla, imported only when XLA is in use."""

from __future__ import annotations

import sys
from typing import Any

import torch

from kiln.accelerators import ACCELERATORS
from kiln.accelerators.base import Accelerator


@ACCELERATORS.register("xla")
class XLAAccelerator(Accelerator):
    name = "xla"

    @classmethod
    def is_available(cls) -> bool:
        # Importing torch_xla starts a runtime (seconds): only a process that already uses XLA counts.
        return "torch_xla" in sys.modules

    def device(self, index: int | None = None) -> torch.device:
        import torch_xla

        return torch_xla.device() if index is None else torch.device("xla", index)

    def manual_seed(self, seed: int) -> None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed)

    def rng_state(self) -> Any:
        import torch_xla.core.xla_model as xm

        return int(xm.get_rng_state())

    def set_rng_state(self, state: Any) -> None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(state))
