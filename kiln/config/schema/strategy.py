"""`strategy`: which strategy places and replicates the model, and its options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from kiln.config.schema.fields import opt


@dataclass
class StrategyConfig:
    """How the model is placed and replicated. `name` picks the class; the other fields are its options."""

    name: str = opt("auto", "single, ddp, fsdp, model_parallel, deepspeed, xla, xla_fsdp, mps or auto.")
    device: Optional[str] = opt(None, "Device for the single strategy (cpu, cuda, cuda:1); default the best available.")
    backend: Optional[str] = opt(None, "torch.distributed backend (nccl, gloo, ...); default by device.")
    timeout: int = opt(1800, "Seconds before a collective times out (ddp_timeout).")
    find_unused_parameters: Optional[bool] = opt(
        None, "DDP find_unused_parameters; unset: on only if the first step leaves a parameter without a gradient."
    )
    bucket_cap_mb: Optional[int] = opt(None, "DDP bucket size in MB.")
    broadcast_buffers: Optional[bool] = opt(None, "DDP broadcast_buffers.")
    static_graph: bool = opt(False, "DDP static_graph.")
    options: Dict[str, Any] = opt({}, "Further strategy-specific options (FSDP, model_parallel, DeepSpeed, XLA).")
