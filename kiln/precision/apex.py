"""NVIDIA Apex AMP (`precision: apex`, or HF's `fp16: true` with `half_precision_backend: apex`),
at `precision.fp16_opt_level` O0-O3. Apex is CUDA-only and not on PyPI (the PyPI package named `apex`
is an unrelated web toolkit), so `apex.amp` is imported only when this plugin is used and its absence
is reported before training with how to install it. torch's own `precision: fp16` does the same job
without the extra package and is the recommended path."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
from torch import nn

from kiln.precision import PRECISIONS
from kiln.precision.base import Precision, PrecisionError

INSTALL_HINT = (
    "install NVIDIA apex from source on a machine with CUDA "
    "(git clone https://github.com/NVIDIA/apex && cd apex && pip install -v --no-build-isolation "
    '--config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext" .), '
    "or use torch's built-in mixed precision instead: precision: fp16"
)


def import_apex_amp() -> ModuleType:
    """`apex.amp`, or a PrecisionError saying how to get it (and that PyPI's `apex` is not it)."""
    try:
        return importlib.import_module("apex.amp")
    except ImportError as err:
        try:
            importlib.import_module("apex")
            found = " (an `apex` package is installed, but it is not NVIDIA apex: PyPI's `apex` is unrelated)"
        except ImportError:
            found = ""
        raise PrecisionError(
            f"precision 'apex' needs NVIDIA apex, which is not installed{found}; {INSTALL_HINT}."
        ) from err


@PRECISIONS.register("apex")
class ApexPrecision(Precision):
    """Apex AMP: `amp.initialize(model, optimizer, opt_level)` once both exist, then
    `amp.scale_loss` around every backward. Apex unscales gradients when `scale_loss` exits and
    skips overflowing steps itself; `optimizer_step` reports such a skip."""

    name = "apex"
    compute_dtype = torch.float16
    uses_grad_scaler = True

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.opt_level: str = self.option("fp16_opt_level", "O1")
        self._amp: ModuleType | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending_state: dict[str, Any] | None = None

    @property
    def amp(self) -> ModuleType:
        if self._amp is None:
            self._amp = import_apex_amp()
        return self._amp

    def check_device(self, device: torch.device) -> None:
        super().check_device(device)
        _ = self.amp  # a missing apex is reported first: it is the reason on every machine
        if self.device.type != "cuda":
            raise PrecisionError(
                f"precision 'apex' needs a CUDA GPU, but this run uses {str(self.device)!r}; "
                "use precision: bf16 (or fp16 where the device supports it) for mixed precision here."
            )

    def connect(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        module, optimizer = self.amp.initialize(module, optimizer, opt_level=self.opt_level)
        self._optimizer = optimizer
        if self._pending_state is not None:  # apex restores its scalers only after initialize
            self.amp.load_state_dict(self._pending_state)
            self._pending_state = None
        return module, optimizer

    def backward(self, loss: torch.Tensor) -> None:
        if self._optimizer is None:
            raise RuntimeError("ApexPrecision.connect(module, optimizer) must be called before backward.")
        with self.amp.scale_loss(loss, self._optimizer) as scaled_loss:
            scaled_loss.backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        # on overflow, apex's scale_loss swaps optimizer.step for a one-shot skip and flags it
        stash = getattr(optimizer, "_amp_stash", None)
        skipped = bool(getattr(stash, "already_patched", False))
        optimizer.step()
        if skipped:
            self.skipped_steps += 1
        return not skipped

    def state_dict(self) -> dict[str, Any]:
        amp_state = self.amp.state_dict() if self._optimizer is not None else (self._pending_state or {})
        return {"amp": amp_state, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        amp_state = state.get("amp")
        if not amp_state:
            return
        if self._optimizer is None:
            self._pending_state = amp_state
        else:
            self.amp.load_state_dict(amp_state)
