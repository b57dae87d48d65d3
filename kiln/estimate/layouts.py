"""The strategies and meshes `kiln estimate` compares for a number of processes, and what each keeps per
rank: model states (states.py), the share of the traced activations and of the gradients alive during
backward. A tp mesh's activations are traced with the model split (command.py), so its share (1/tp) is used
only where that trace could not run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.estimate.states import (
    Counts,
    States,
    deepspeed_states,
    deepspeed_width,
    reduce_bucket,
    torch_states,
    weight_bytes,
)


@dataclass(frozen=True)
class Layout:
    strategy: str
    mesh: str
    states: States
    activation_share: float = 1.0
    #: the fraction of the full gradients a rank keeps during backward (sharded: 1/N, offloaded: 0)
    grad_share: float = 1.0
    #: optimizer temporaries at the step (foreach AdamW: one tensor per weight)
    step_temporaries: float = 0.0
    #: the tensor-parallel degree: a trace of the model split that many ways replaces the shares (report.peak)
    tp: int = 1


def divisors(n: int) -> list[int]:
    return [d for d in range(2, n) if n % d == 0]


def tp_sizes(nproc: int) -> list[int]:
    """The tp degrees of the model_parallel rows for `nproc` processes (the rest of them dp_shard)."""
    return [*divisors(nproc), nproc] if nproc > 1 else []


@dataclass(frozen=True)
class Setting:
    """The run's choices the layouts read: precision, optimizer, the largest unit FSDP gathers, and the
    DeepSpeed config's zero_optimization section (its bucket sizes; empty: DeepSpeed's defaults)."""

    precision: str
    optim: str
    optim_args: str | None
    largest_unit: int
    zero: Mapping[str, Any] = field(default_factory=dict)


def layouts(counts: Counts, nproc: int, s: Setting) -> list[Layout]:
    """Every layout `nproc` processes can run, in the order the table shows them."""
    w = weight_bytes(s.precision)
    full_grads = counts.trainable * w
    foreach = counts.trainable * w if s.optim.lower() in ("adamw_torch", "adam", "adamw") else 0.0

    def torch_layout(
        strategy: str, mesh: str, shard: int, gathered: int = 0, offload: bool = False, tp: int = 1
    ) -> Layout:
        buckets = strategy == "ddp"
        states = torch_states(counts, s.precision, s.optim, s.optim_args, shard, gathered, offload, buckets)
        share = 0.0 if offload else 1 / shard
        return Layout(strategy, mesh, states, 1 / tp, share, 0.0 if offload else foreach / shard, tp)

    rows = [torch_layout("single", "1 device", 1)] if nproc == 1 else []
    rows.append(torch_layout("ddp", f"dp_replicate={nproc}", 1))
    unit = s.largest_unit
    rows.append(torch_layout("fsdp full_shard", f"dp_shard={nproc}", nproc, unit))
    rows += [
        torch_layout("fsdp hybrid_shard", f"dp_replicate={nproc // d}, dp_shard={d}", d, unit) for d in divisors(nproc)
    ]
    rows.append(torch_layout("fsdp no_shard", f"dp_replicate={nproc}", 1, unit))
    rows.append(torch_layout("fsdp full_shard offload", f"dp_shard={nproc}", nproc, unit, offload=True))
    dw = deepspeed_width(s.precision)
    for stage in (0, 1, 2, 3):
        bucket = reduce_bucket(stage, s.zero, dw)
        states = deepspeed_states(counts, stage, nproc, s.optim, s.optim_args, w=dw, bucket=bucket)
        share = states.grads / full_grads if full_grads else 0.0
        # kiln's foreach AdamW steps DeepSpeed's fp32 partition: one fp32 temporary per element. ZeRO-3 also
        # flattens its gradient partitions into a new fp32 gradient for that partition at each step
        # (stage3's `_prepare_fp32_grad_for_sub_group`), which its estimator (the states) leaves out; ZeRO-1/2
        # keep theirs among the states
        temporaries = 4 * foreach / w / (nproc if stage else 1) + (4 * counts.trainable / nproc if stage == 3 else 0)
        rows.append(Layout("deepspeed", f"ZeRO-{stage}", states, 1.0, share, temporaries))
    for stage, params in ((2, False), (3, False), (3, True)):
        offloaded = {**s.zero, "offload_optimizer": {"device": "cpu"}}
        bucket = reduce_bucket(stage, offloaded, dw)
        states = deepspeed_states(counts, stage, nproc, s.optim, s.optim_args, True, params, dw, bucket)
        where = "optimizer and parameters" if params else "optimizer"
        rows.append(Layout("deepspeed", f"ZeRO-{stage} offload {where}", states, 1.0, 0.0))
    for tp in tp_sizes(nproc):
        gathered = unit // tp if nproc > tp else 0  # FSDP gathers a unit only where a dp axis shards it
        rows.append(torch_layout("model_parallel", f"dp_shard={nproc // tp} x tp={tp}", nproc, gathered, tp=tp))
    return rows
