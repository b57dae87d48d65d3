"""What the precision plugin becomes under DeepSpeed (`DeepSpeedPrecision`): DeepSpeed's engine casts the module
and scales the loss itself."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kiln.precision.base import Precision, cast_floating

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class HoldsEngine(Protocol):
    """The DeepSpeed strategy, as far as its precision plugin reads it: the engine, once set up (else None)."""

    engine: Any


class DeepSpeedPrecision(Precision):
    """What the precision plugin becomes under DeepSpeed: the engine casts the module and scales
    the loss itself (the `fp16` / `bf16` sections of its config), so the plugin only casts float
    inputs to the engine's dtype and reports the fp16 steps the engine skipped."""

    def __init__(self, original: Precision, dtype: str | None, strategy: HoldsEngine) -> None:
        super().__init__(original.config)
        self.name = original.name  # type: ignore[misc]  # the run still reports the plugin it asked for
        self.dtype = _DTYPES.get(dtype or "")
        self.param_dtype = self.compute_dtype = self.dtype  # type: ignore[misc]
        self.uses_grad_scaler = dtype == "fp16"  # type: ignore[misc]
        self._strategy = strategy

    @property
    def skipped_steps(self) -> int:
        engine = self._strategy.engine
        return int(getattr(engine, "skipped_steps", 0)) if engine is not None else 0

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:  # the base class sets it; the engine owns it
        pass

    def convert_input(self, batch: Any) -> Any:
        return cast_floating(batch, self.dtype) if self.dtype is not None else batch
