"""The CPU: torch's default generator is seeded and captured by kiln's seeding itself, so this
accelerator only answers the dtype question (fp16 needs AVX512-FP16/AMX-FP16 kernels)."""

from __future__ import annotations

import torch

from kiln.accelerators import ACCELERATORS
from kiln.accelerators.base import Accelerator


def cpu_supports_fp16() -> bool:
    """Whether oneDNN has fp16 kernels on this CPU (AVX512-FP16 / AMX-FP16). A function so tests can
    pretend either way."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


@ACCELERATORS.register("cpu")
class CPUAccelerator(Accelerator):
    name = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def dtype_unsupported(self, dtype: torch.dtype, device: torch.device) -> str | None:
        # looked up through the module so that tests can pretend either way
        from kiln.accelerators import cpu

        if dtype is torch.float16 and not cpu.cpu_supports_fp16():
            return (
                "this CPU lacks fp16 kernels (AVX512-FP16 or AMX-FP16; "
                "torch.ops.mkldnn._is_mkldnn_fp16_supported() is False)"
            )
        return None
