"""True half precision: the model itself is cast to fp16 or bf16 (`fp16-true`, `bf16-true`), which
halves the memory of weights, gradients and optimizer states, for memory-bound fine-tuning.

- `convert_module` casts floating-point parameters and buffers (integer buffers stay as they are).
- `convert_input` casts floating-point tensors of the batch to the same dtype, so fp32 features from a
  dataloader meet half weights; integer inputs (token ids, class labels) are untouched.
- `forward_context` autocasts nothing; it makes the half dtype the default dtype, so tensors created
  inside the forward pass (`torch.zeros(...)`, `torch.arange(..., dtype=torch.get_default_dtype())`)
  match the weights.
- Optimizer states follow the parameters: an optimizer built over half parameters keeps its states
  (Adam's moments) in half too. There are no fp32 master weights and no loss scaling: prefer bf16-true;
  with fp16-true, Adam's default epsilon 1e-8 underflows to 0 in fp16, so use adam_epsilon >= 1e-4
  (a warning says so when the optimizer's eps would vanish)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from kiln.precision import PRECISIONS
from kiln.precision.base import Precision, cast_floating, check_dtype_on_device

log = logging.getLogger(__name__)

#: the epsilon to suggest for fp16 optimizer states: a round number above fp16's smallest normal (6.1e-05)
FP16_SAFE_EPS = 1e-4


def vanishing_eps(optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> list[float]:
    """The `eps` values of the optimizer's parameter groups that round to zero in `dtype`."""
    return sorted(
        {
            float(g["eps"])
            for g in optimizer.param_groups
            if isinstance(g.get("eps"), float) and g["eps"] > 0 and float(torch.tensor(g["eps"], dtype=dtype)) == 0
        }
    )


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class HalfPrecision(Precision):
    """The module, its inputs and its math in `param_dtype`; subclasses pick the dtype."""

    param_dtype: ClassVar[torch.dtype] = torch.bfloat16
    compute_dtype: ClassVar[torch.dtype] = torch.bfloat16

    def check_device(self, device: torch.device) -> None:
        super().check_device(device)
        check_dtype_on_device(self.param_dtype, self.device, f"precision {self.name!r}")

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.param_dtype)

    def convert_input(self, batch: Any) -> Any:
        return cast_floating(batch, self.param_dtype)

    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        return default_dtype(self.param_dtype)


@PRECISIONS.register("bf16-true")
class BF16TruePrecision(HalfPrecision):
    name = "bf16-true"
    param_dtype = torch.bfloat16
    compute_dtype = torch.bfloat16


@PRECISIONS.register("fp16-true", "16-true")
class FP16TruePrecision(HalfPrecision):
    name = "fp16-true"
    param_dtype = torch.float16
    compute_dtype = torch.float16

    def connect(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        # Adam-style updates divide by sqrt(v) + eps in the parameters' dtype: an eps that is 0 in
        # fp16 lets a zero second moment blow the update up to inf
        for eps in vanishing_eps(optimizer, self.param_dtype):
            log.warning(
                "precision 'fp16-true': the optimizer's eps=%g rounds to 0 in fp16; set adam_epsilon: %g "
                "(or use bf16-true).",
                eps,
                FP16_SAFE_EPS,
            )
        return super().connect(module, optimizer)
