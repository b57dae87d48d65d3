"""Bytes a rank holds for the model's states (parameters, gradients, optimizer state) under each layout.

The rules, per parameter (P parameters, T of them trainable, N the ranks a state is sharded over):

- weights: 4 bytes (fp32, tf32, and the mixed-precision plugins bf16/fp16/fp8/apex, which keep fp32
  weights and cast in autocast), 2 under bf16-true / fp16-true;
- gradients: one per trainable weight, in the weight's dtype;
- optimizer state: the optimizer's states per trainable weight (AdamW 2, SGD with momentum 1, ...), in
  the weight's dtype (torch's optimizers keep them so), or their own width (8-bit optimizers: 1 byte a
  state); Adafactor keeps a row and a column vector per matrix.

DeepSpeed keeps 16-bit weights and gradients and an fp32 copy with the optimizer, and is counted as its
own `estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs` count it (the
anchors; tests/estimate checks the equality): 2 bytes of 16-bit weights (sharded under ZeRO-3, where
the largest layer is gathered whole, 4 bytes a parameter), and 18 bytes a parameter for the fp32
weights, fp32 and 16-bit gradients and Adam's two states (10 + the optimizer's states at 4 bytes each
when it is not Adam), sharded from stage 1 (the fp32 part), 2 (the gradients) and 3 (the weights);
offloaded, that part lives on the host. An fp32 run keeps those "16-bit" weights and gradients at 4 bytes
(DeepSpeed casts the module only when its bf16 / fp16 section is on). Beside the states, ZeRO's optimizer
allocates its gradient reduction bucket (`reduce_bucket`), which DeepSpeed's estimators leave out."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.utils.errors import ConfigError

#: optimizer name (HF's `optim` names) -> states a trainable weight keeps, each `STATE_BYTES` wide when given
STATES: dict[str, float] = {
    "adamw": 2,
    "adam": 2,
    "lion": 1,
    "rmsprop": 1,
    "adagrad": 1,
    "sgd": 0,  # HF's sgd has no momentum; optim_args momentum=... adds one (optimizer_states)
    "adafactor": 0,  # factored: a row and a column per matrix (adafactor_bytes)
    "schedule_free_adamw": 3,
    "schedule_free_sgd": 1,
    "schedule_free_radam": 3,
}
#: 8-bit optimizers keep one byte a state
EIGHT_BIT = ("8bit", "bnb_8bit")
HALF = ("bf16-true", "fp16-true")
#: the precisions kiln.config.hf.deepspeed turns into DeepSpeed's bf16 / fp16 sections (16-bit weights)
DEEPSPEED_HALF = ("bf16", "fp16", *HALF)
#: DeepSpeed's zero_optimization.reduce_bucket_size default, in elements
REDUCE_BUCKET_SIZE = 500_000_000


@dataclass(frozen=True)
class Counts:
    """What the rules read from the model: its parameters' shapes (trainable ones flagged), once each,
    and its largest layer's parameter count (ZeRO-3 gathers one whole)."""

    shapes: tuple[tuple[tuple[int, ...], bool], ...]
    largest_layer: int

    @property
    def total(self) -> int:
        return sum(math.prod(shape) for shape, _ in self.shapes)

    @property
    def trainable(self) -> int:
        return sum(math.prod(shape) for shape, trains in self.shapes if trains)


def optimizer_states(name: str, optim_args: str | None = None) -> tuple[float, int | None]:
    """(states a trainable weight keeps, bytes a state when not the weight's width) for optimizer `name`."""
    key = name.lower()
    width = 1 if any(key.endswith(tag) for tag in EIGHT_BIT) else None
    for prefix in sorted(STATES, key=len, reverse=True):  # schedule_free_adamw before adamw
        if key.startswith(prefix) or key.startswith(f"paged_{prefix}"):
            states = STATES[prefix]
            if prefix == "sgd" and _momentum(optim_args):
                states = 1
            return states, width
    raise ConfigError(
        f"kiln estimate does not know how much state optimizer {name!r} keeps; it knows "
        f"{', '.join(sorted(STATES))} (and their 8-bit and paged variants)."
    )


def _momentum(optim_args: str | None) -> float:
    """SGD's momentum in HF's `optim_args` ('momentum=0.9,nesterov=True'); 0 when not given."""
    pairs = dict(item.split("=", 1) for item in (optim_args or "").replace(" ", "").split(",") if "=" in item)
    return float(pairs.get("momentum", 0))


def adafactor_elements(shapes: Sequence[tuple[tuple[int, ...], bool]]) -> int:
    """Adafactor's factored second moment: rows + columns for a matrix, the tensor itself otherwise."""
    return sum((shape[-2] + shape[-1]) if len(shape) >= 2 else math.prod(shape) for shape, trains in shapes if trains)


@dataclass(frozen=True)
class States:
    """Bytes of one rank's model states; `gathered` is the largest unit (its weights and gradients, and
    FSDP2's all-gather buffer over more than one rank) a sharded layout gathers whole during forward and
    backward, `buckets` DDP's gradient buckets (a copy of every gradient: torch's default,
    gradient_as_bucket_view off) or DeepSpeed's reduce bucket, `host` what offloading keeps on the host."""

    params: float
    grads: float
    optimizer: float
    gathered: float = 0.0
    host: float = 0.0
    buckets: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.gathered + self.buckets


def weight_bytes(precision: str) -> int:
    return 2 if precision in HALF else 4


def optimizer_bytes(counts: Counts, precision: str, optim: str, optim_args: str | None = None) -> float:
    """All ranks' optimizer state together (bytes), before any sharding."""
    states, width = optimizer_states(optim, optim_args)
    each = width if width is not None else weight_bytes(precision)
    if optim.lower().startswith("adafactor"):
        return adafactor_elements(counts.shapes) * weight_bytes(precision)
    return states * counts.trainable * each


def torch_states(
    counts: Counts,
    precision: str,
    optim: str,
    optim_args: str | None,
    shard: int = 1,
    gathered_params: int = 0,
    offload: bool = False,
    buckets: bool = False,
) -> States:
    """DDP, single, FSDP2 and the mesh: weights, gradients and state in the weight's dtype, each 1/`shard`;
    a sharded layout gathers `gathered_params` whole; `offload` keeps the shards on the host; `buckets`:
    DDP's gradient buckets."""
    w = weight_bytes(precision)
    params, grads = counts.total * w / shard, counts.trainable * w / shard
    optimizer = optimizer_bytes(counts, precision, optim, optim_args) / shard
    # the unit's weights and gradients, and over more than one rank the flat buffer FSDP2 all-gathers a unit into
    # (copied out into the weights; in forward it is freed only after the next unit's copy-out); on one rank
    # FSDP2 takes the weights from the shards directly, with no buffer
    gathered = (2.0 + (shard > 1)) * gathered_params * w
    if offload:
        return States(0.0, 0.0, 0.0, gathered, host=params + grads + optimizer)
    return States(params, grads, optimizer, gathered, buckets=grads if buckets else 0.0)


def deepspeed_states(
    counts: Counts,
    stage: int,
    ranks: int,
    optim: str,
    optim_args: str | None = None,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    w: int = 2,
    bucket: float = 0.0,
) -> States:
    """ZeRO stage 0-3 with DeepSpeed's own accounting (module docstring): `w` bytes a weight and gradient
    (2: 16-bit training, as DeepSpeed's estimators count; 4: fp32), `bucket` its reduce bucket's bytes."""
    states, width = optimizer_states(optim, optim_args)
    per_state = 4 if width is None else width
    rest = 8 + w + states * per_state  # fp32 weights 4, fp32 gradients 4, the w-byte gradients, the optimizer's states
    total, largest = counts.total, counts.largest_layer
    if stage == 3:
        gathered = 2.0 * w * largest
        if offload_params:
            return States(0.0, 0.0, 0.0, gathered, host=(rest + w) * total, buckets=bucket)
        if offload_optimizer:
            return States(w * total / ranks, 0.0, 0.0, gathered, host=rest * total, buckets=bucket)
        # DeepSpeed counts 18 bytes (Adam) here too: the 16-bit weights and gradients and fp32 weights and state
        return States(w * total / ranks, w * total / ranks, (rest - 2 * w) * total / ranks, gathered, buckets=bucket)
    if offload_optimizer and stage >= 1:
        return States(float(w * total), 0.0, 0.0, host=rest * total, buckets=bucket)
    grads = w * total / (ranks if stage == 2 else 1)
    fp32 = (rest - w) * total / (ranks if stage >= 1 else 1)
    return States(float(w * total), grads, fp32, buckets=bucket)


def deepspeed_width(precision: str) -> int:
    """Bytes of DeepSpeed's module weights and gradients: 2 when the run turns on its bf16 / fp16 section."""
    return 2 if precision in DEEPSPEED_HALF else 4


def reduce_bucket(stage: int, zero: Mapping[str, Any], w: int) -> float:
    """Bytes of the gradient reduction bucket ZeRO's optimizer allocates beside the model states, from the
    run's `zero_optimization` section (DeepSpeed's defaults for what it leaves out), `w` bytes an element
    (the module's dtype: DeepSpeed's stage_1_and_2 `_gradient_reduction_buffer_dtype`, stage3's
    `communication_data_type`). Stages 1-2 allocate `reduce_bucket_size` elements in `setup_buckets` when
    gradients are contiguous (always with an offloaded optimizer), a second one with `overlap_comm`;
    stage 3 one at set-up (its overlap_comm, on by default, adds none); stage 0 has no ZeRO optimizer."""
    offload = str((zero.get("offload_optimizer") or {}).get("device", "none")) in ("cpu", "nvme")
    contiguous = zero.get("contiguous_gradients", True) or (offload and stage < 3)
    if stage == 0 or not contiguous:
        return 0.0
    size = float(zero.get("reduce_bucket_size", REDUCE_BUCKET_SIZE)) * w
    overlap = zero.get("overlap_comm") or False  # DeepSpeed's default: on for stage 3 only
    return size * (2 if overlap and stage < 3 else 1)
