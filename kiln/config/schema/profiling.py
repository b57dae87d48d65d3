"""`profile` and `memory_snapshot`: where a run's time and memory go."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from kiln.config.schema.fields import opt


@dataclass
class ProfileConfig:
    """torch.profiler over chosen optimizer steps, a trace per rank under output_dir/profiles (TensorBoard's
    profiler plugin and chrome://tracing / Perfetto open it). accelerate's ProfileKwargs names are accepted."""

    active: int = opt(0, "Optimizer steps recorded per cycle; 0: no profiler (`kiln fit --profile` records 3).")
    wait: int = opt(1, "Steps skipped at the start of each cycle.")
    warmup: int = opt(1, "Steps profiled but discarded before the active ones (the profiler's own start-up cost).")
    repeat: int = opt(1, "Cycles of wait + warmup + active; 0: cycle until training ends.")
    skip_first: int = opt(0, "Steps skipped once, before the first cycle.")
    ranks: Optional[List[int]] = opt(None, "Global ranks that profile; unset: every rank.")
    activities: Optional[List[str]] = opt(
        None, "cpu, cuda, xpu: what is traced; unset: cpu, and the GPU when training on one."
    )
    record_shapes: bool = opt(False, "Record each operator's input shapes.")
    profile_memory: bool = opt(False, "Track tensor allocations and frees.")
    with_stack: bool = opt(False, "Record the Python source line of each operator.")
    with_flops: bool = opt(False, "Estimate the FLOPs of matmuls and convolutions.")
    with_modules: bool = opt(False, "Record the module hierarchy of each operator.")
    schedule_option: Optional[Dict[str, int]] = opt(
        None, "accelerate's form of the schedule ({wait, warmup, active, repeat, skip_first}); overrides those keys."
    )
    output_trace_dir: Optional[str] = opt(None, "Where the traces go (default output_dir/profiles).")


@dataclass
class MemorySnapshotConfig:
    """CUDA allocation history for PyTorch's memory viewer (pytorch.org/memory_viz); CUDA only."""

    steps: List[int] = opt([], "Optimizer steps (global_step, from 1) after which a snapshot is dumped.")
    on_oom: bool = opt(False, "Dump a snapshot when CUDA runs out of memory; the error then names it.")
    max_entries: int = opt(100000, "Allocation events kept in the history.")
    output_dir: Optional[str] = opt(None, "Where the snapshots go (default output_dir/memory_snapshots).")
