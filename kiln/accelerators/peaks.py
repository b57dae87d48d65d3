"""Dense peak FLOP/s of the accelerators MFU is usually reported against, from the vendors' data sheets
(tensor-core figures without sparsity; fp32 is the plain, non-TF32 rate). MFU divides the achieved
FLOP/s by the peak of the number format the matmuls run in, so a bf16 run on an H100 is measured
against 989 TFLOP/s and an fp8 run against 1979. `log.mfu_peak_tflops` overrides the table (any other
device, a clock-limited part, or the CPU, which has no entry)."""

from __future__ import annotations

#: (a piece of the device name, {number format: TFLOP/s}); the first piece found in the name wins, so a
#: variant's longer name comes before its family's
PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756.0, "fp8": 1513.0, "tf32": 378.0, "fp32": 51.0}),
    ("H100 NVL", {"bf16": 835.0, "fp8": 1671.0, "tf32": 418.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9}),
    ("H200", {"bf16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L4", {"bf16": 121.0, "fp8": 242.0, "tf32": 60.0, "fp32": 30.3}),
    ("MI300X", {"bf16": 1307.4, "fp8": 2614.9, "tf32": 653.7, "fp32": 163.4}),
    ("MI300A", {"bf16": 980.6, "fp8": 1961.2, "tf32": 490.3, "fp32": 122.6}),
)

#: precision plugin name -> the number format its matmuls run in (fp16 runs at the bf16 rate)
FORMATS = {
    "fp32": "fp32",
    "tf32": "tf32",
    "fp16": "bf16",
    "bf16": "bf16",
    "fp16-true": "bf16",
    "bf16-true": "bf16",
    "apex": "bf16",
    "fp8": "fp8",
    "mxfp8": "fp8",
}


def peak_tflops(device_name: str | None, precision: str, tf32: bool = False) -> float | None:
    """The table's peak for `device_name` running `precision`'s matmuls (TF32 when `tf32` lets fp32 use it),
    or None: an unknown device or format."""
    if not device_name:
        return None
    number_format = FORMATS.get(precision)
    if number_format == "fp32" and tf32:
        number_format = "tf32"
    for piece, peaks in PEAKS:
        if piece in device_name:
            return peaks.get(number_format or "")
    return None
