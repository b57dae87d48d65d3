"""`strategy: mps`: one Apple-silicon GPU through Metal. `strategy: auto` picks it on a Mac where
MPS is available (HF's deprecated `use_mps_device: true` asks for it too).

It is the single-device strategy with the device fixed to `mps`: everything MPS-specific (RNG state,
memory counters, cache, bf16 support) lives in `kiln/accelerators/mps.py`. What MPS cannot do is
refused by the capability table before anything starts: process-group strategies (no gloo/NCCL
collectives on MPS), apex and TF32 (CUDA-only). Operators MPS lacks raise in torch unless the user
sets `PYTORCH_ENABLE_MPS_FALLBACK=1` (run them on the CPU); kiln never sets it behind the user's back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kiln.strategies import STRATEGIES
from kiln.strategies.capabilities import Capabilities
from kiln.strategies.devices import resolve_device
from kiln.strategies.single import SingleDeviceStrategy
from kiln.utils.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.precision.base import Precision


@STRATEGIES.register("mps")
class MPSStrategy(SingleDeviceStrategy):
    name = "mps"
    capabilities = Capabilities(
        devices=frozenset({"mps"}),
        precisions=frozenset({"fp32", "fp16", "bf16", "fp16-true", "bf16-true"}),
        reasons={
            "apex": "apex is CUDA-only; use precision: fp16 or bf16",
            "tf32": "TF32 is a mode of NVIDIA GPUs; use precision: fp32",
            "fp8": "Apple GPUs have no float8 matmuls; use precision: bf16",
            "cpu": "it is the Apple-GPU strategy",
            "cuda": "it is the Apple-GPU strategy",
        },
    )

    def __init__(self, config: DictConfig, precision: Precision) -> None:
        requested = config.strategy.device
        if requested is not None and torch.device(requested).type != "mps":
            raise ConfigError(
                f"strategy 'mps' runs on the Apple GPU, not on strategy.device={requested!r}; "
                "leave strategy.device unset, or use strategy: single for that device."
            )
        self._device = resolve_device("mps")
        super(SingleDeviceStrategy, self).__init__(config, precision)
