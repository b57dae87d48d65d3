"""NVIDIA GPUs (and ROCm, which torch exposes as `cuda`)."""

from __future__ import annotations

from typing import Any

import torch

from kiln.accelerators import ACCELERATORS
from kiln.accelerators.base import Accelerator


def cuda_supports_bf16() -> bool:
    """Native bf16 on the current GPU (Ampere or newer); emulated bf16 is too slow to train with."""
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch without the argument
        return bool(torch.cuda.is_bf16_supported())


@ACCELERATORS.register("cuda")
class CUDAAccelerator(Accelerator):
    name = "cuda"
    pin_memory = True

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def rng_state(self) -> Any:
        return torch.cuda.get_rng_state_all()

    def set_rng_state(self, state: Any) -> None:
        for index, device_state in enumerate(list(state)[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def has_memory_stats(self) -> bool:
        return True

    def memory_allocated(self) -> int:
        return int(torch.cuda.memory_allocated())

    def max_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated())

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def device_name(self, device: torch.device) -> str | None:
        return str(torch.cuda.get_device_name(device))

    def dtype_unsupported(self, dtype: torch.dtype, device: torch.device) -> str | None:
        if dtype is torch.bfloat16 and not cuda_supports_bf16():
            return f"this GPU ({torch.cuda.get_device_name(device)}) does not support it (bf16 needs Ampere or newer)"
        return None
