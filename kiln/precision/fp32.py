"""Full fp32 precision: the Precision defaults, registered under its names."""

from __future__ import annotations

from kiln.precision import PRECISIONS
from kiln.precision.base import Precision


@PRECISIONS.register("fp32", "32", "32-true", "no")
class FP32Precision(Precision):
    name = "fp32"
