"""`precision`: the precision plugin and its float8 / MXFP8 recipes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from kiln.config.schema.fields import opt


@dataclass
class Float8Config:
    """float8 training through torchao (`precision: fp8`, needs `pip install 'kiln[float8]'`)."""

    recipe: str = opt(
        "tensorwise",
        "torchao's scaling recipe: tensorwise (fastest), rowwise (more accurate) or rowwise_with_gw_hp "
        "(rowwise, the weight gradient in high precision).",
    )
    exclude: List[str] = opt(
        ["lm_head"],
        "Linear layers left in high precision: a run of name parts (lm_head, layers.0) or a glob over the "
        "qualified name (*.mlp.*). Layers whose dimensions are not multiples of 16 are always left.",
    )
    emulate: bool = opt(
        False,
        "Emulate float8 matmuls in high precision (same numbers, no speed-up); required where the hardware "
        "has none (the CPU, GPUs below compute capability 8.9).",
    )
    fsdp_float8_all_gather: Optional[bool] = opt(
        None,
        "Under FSDP, cast each weight shard to float8 before the all-gather (half of bf16's traffic, and the "
        "weight rounded once, from fp32). tensorwise only; unset: on for tensorwise.",
    )


@dataclass
class MXFP8Config:
    """MXFP8 training through torchao (`precision: mxfp8`, needs `pip install 'kiln[float8]'`): float8 values in
    blocks of 32 that share a power-of-two scale."""

    recipe: str = opt(
        "rceil", "torchao's recipe: rceil, or rceil_wgrad_with_hp (the weight gradient in high precision)."
    )
    exclude: List[str] = opt(
        ["lm_head"],
        "Linear layers left in high precision, named as for precision.fp8.exclude. Layers whose dimensions "
        "are not multiples of 32 are always left.",
    )
    emulate: bool = opt(
        False,
        "Emulate MXFP8 matmuls in high precision (same numbers, no speed-up); required where the hardware has "
        "none (the CPU, GPUs below compute capability 10.0).",
    )


@dataclass
class PrecisionConfig:
    """Numeric precision. `name` picks the plugin."""

    name: str = opt("fp32", "fp32, fp16, bf16, fp16-true, bf16-true, tf32, apex, fp8 or mxfp8.")
    tf32: Optional[bool] = opt(None, "Allow TF32 matmuls on Ampere+ GPUs (combinable with any plugin).")
    fp16_opt_level: str = opt("O1", "Apex AMP optimisation level O0-O3.")
    half_precision_backend: str = opt("auto", "auto, cpu_amp, cuda_amp or apex.")
    full_eval: Optional[str] = opt(None, "Run evaluation with the model cast to fp16 or bf16.")
    fp8: Float8Config = field(default_factory=Float8Config)
    mxfp8: MXFP8Config = field(default_factory=MXFP8Config)
