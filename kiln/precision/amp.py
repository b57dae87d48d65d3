"""Mixed precision with torch.amp: weights and optimizer stay fp32, the forward pass runs under
autocast in fp16 or bf16.

fp16 has a narrow exponent range, so small gradients underflow to zero: the loss is multiplied by a
dynamic scale before backward (`GradScaler`), gradients are unscaled before clipping so that norms
are true norms, and a step whose gradients hold inf/nan is skipped (the scale halves, the optimizer
and the scheduler do not move, `skipped_steps` counts it). bf16 has fp32's exponent range and needs
none of this.

The autocast device type is the type of the device passed to `check_device`."""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch

from kiln.precision import PRECISIONS
from kiln.precision.base import Precision, PrecisionError, check_dtype_on_device

#: half_precision_backend -> the device type it insists on ("auto" follows the device)
_BACKEND_DEVICE = {"cpu_amp": "cpu", "cuda_amp": "cuda"}


class MixedPrecision(Precision):
    """Autocast to `compute_dtype`; subclasses pick the dtype."""

    compute_dtype: ClassVar[torch.dtype] = torch.bfloat16

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.backend: str = self.option("half_precision_backend", "auto")

    def check_device(self, device: torch.device) -> None:
        super().check_device(device)
        device = self.device
        wanted = _BACKEND_DEVICE.get(self.backend)
        if wanted is not None and device.type != wanted:
            raise PrecisionError(
                f"precision.half_precision_backend is {self.backend!r}, which needs a {wanted} device, but this "
                f"run uses {str(device)!r}; set half_precision_backend to 'auto' to autocast on {device.type}."
            )
        if not torch.amp.is_autocast_available(device.type):
            raise PrecisionError(
                f"precision {self.name!r} needs autocast, which torch does not support on {device.type!r}; "
                "use precision: fp32 on this device."
            )
        check_dtype_on_device(self.compute_dtype, device, f"precision {self.name!r}")

    def forward_context(self) -> AbstractContextManager[Any]:
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)


@PRECISIONS.register("bf16", "bf16-mixed")
class BF16MixedPrecision(MixedPrecision):
    """bf16 autocast, no loss scaling (bf16 covers fp32's exponent range)."""

    name = "bf16"
    compute_dtype = torch.bfloat16


@PRECISIONS.register("fp16", "16-mixed", "16")
class FP16MixedPrecision(MixedPrecision):
    """fp16 autocast with a dynamic loss scale (`torch.amp.GradScaler` for the device type).

    A strategy that needs another scaler (FSDP's `ShardedGradScaler`) passes it as `scaler`."""

    name = "fp16"
    compute_dtype = torch.float16
    uses_grad_scaler = True

    def __init__(self, config: Any = None, scaler: torch.amp.GradScaler | None = None) -> None:
        super().__init__(config)
        self._scaler = scaler
        self._built_for: str | None = None  # device type of a scaler this plugin built (not a given one)
        self._unscaled: set[int] = set()  # optimizers unscaled since their last step

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The GradScaler, created on first use for the device type `check_device` saw."""
        if self._scaler is None:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                scaler = torch.amp.GradScaler(self.device.type)
            if not scaler.is_enabled():
                reason = f" ({caught[0].message})" if caught else ""
                raise PrecisionError(
                    f"precision 'fp16' needs a gradient scaler, and torch.amp.GradScaler does not work on "
                    f"{self.device.type!r}{reason}; use precision: bf16 (no scaler needed) or fp32."
                )
            self._scaler, self._built_for = scaler, self.device.type
        return self._scaler

    def check_device(self, device: torch.device) -> None:
        super().check_device(device)
        if self._built_for not in (None, self.device.type):
            # built before the device was known (e.g. a state_dict loaded first): rebuild it there
            state = self.scaler.state_dict()
            self._scaler = None
            self.scaler.load_state_dict(state)
        _ = self.scaler  # fails now, not at the first step, if the device has no scaler

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._unscaled:
            return
        self.scaler.unscale_(optimizer)
        self._unscaled.add(id(optimizer))

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale (if the loop has not), step unless the gradients hold inf/nan, update the scale.

        The scale only ever shrinks when inf/nan gradients were found (backoff_factor < 1), so a
        smaller scale after `update()` is exactly "this step was skipped"."""
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        self._unscaled.discard(id(optimizer))
        stepped = self.scaler.get_scale() >= scale_before
        if not stepped:
            self.skipped_steps += 1
        return stepped

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
