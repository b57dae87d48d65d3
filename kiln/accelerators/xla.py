"""XLA devices (TPU, or CPU/GPU through PJRT) via torch_xla, imported only when XLA is in use.

The RNG stream is XLA's own seed (`xm.get_rng_state`), saved in checkpoints beside torch's; memory
counters come from `xm.get_memory_info` where the runtime reports them (PJRT CPU does not); the
metrics report (compilations, device->host transfers) is what `debug: tpu_metrics_debug` prints."""

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

    def device_count(self) -> int:
        if not self.is_available():
            return 0
        import torch_xla.runtime as xr

        return int(xr.global_runtime_device_count())

    # -- random streams ----------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed)

    def rng_state(self) -> Any:
        import torch_xla.core.xla_model as xm

        return int(xm.get_rng_state())

    def set_rng_state(self, state: Any) -> None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(state))

    # -- memory ------------------------------------------------------------------------------
    def _memory_info(self) -> dict[str, Any]:
        import torch_xla.core.xla_model as xm

        try:
            return dict(xm.get_memory_info(self.device()))
        except (RuntimeError, ValueError, AttributeError):  # PJRT CPU has no memory counters
            return {}

    def has_memory_stats(self) -> bool:
        return self.is_available() and "bytes_used" in self._memory_info()

    def memory_allocated(self) -> int:
        return int(self._memory_info().get("bytes_used", 0))

    def max_memory_allocated(self) -> int:
        info = self._memory_info()
        return int(info.get("peak_bytes_used", info.get("bytes_used", 0)))

    # -- numerics ----------------------------------------------------------------------------
    def dtype_unsupported(self, dtype: torch.dtype, device: torch.device) -> str | None:
        if dtype is torch.float16:
            return "XLA trains in bf16, not fp16 (there is no fp16 loss scaler for XLA devices)"
        return None

    # -- debugging ---------------------------------------------------------------------------
    def metrics_report(self) -> str | None:
        import torch_xla.debug.metrics as met

        return str(met.metrics_report())
