"""`precision: tf32`: fp32 weights and math with TF32 tensor-core matmuls (the flags themselves live
in `tf32_flags.py`, which every plugin uses through `Precision.setup`)."""

from __future__ import annotations

from typing import Any

from kiln.precision import PRECISIONS
from kiln.precision.fp32 import FP32Precision
from kiln.utils.errors import PrecisionError


@PRECISIONS.register("tf32")
class TF32Precision(FP32Precision):
    """fp32 weights and math, with TF32 tensor-core matmuls/convolutions (`precision: tf32` is
    `precision: fp32` plus `tf32: true`)."""

    name = "tf32"

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        if self.option("tf32") is False:
            raise PrecisionError(
                "precision is 'tf32' but precision.tf32 is false; use precision: fp32 with tf32: false, "
                "or drop tf32: false."
            )

    @property
    def tf32(self) -> bool:
        return True
