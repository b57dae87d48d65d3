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
offloaded, that part lives on the host."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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
    """Bytes of one rank's model states; `gathered` is the largest unit (weights and gradients) a sharded
    layout gathers whole during forward and backward, `buckets` DDP's gradient buckets (a copy of every
    gradient: torch's default, gradient_as_bucket_view off), `host` what offloading keeps on the host."""

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
    gathered = 2.0 * gathered_params * w  # the unit's weights and gradients
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
) -> States:
    """ZeRO stage 0-3 with DeepSpeed's own accounting (module docstring); 16-bit training, as DeepSpeed runs it."""
    states, width = optimizer_states(optim, optim_args)
    per_state = 4 if width is None else width
    rest = 10 + states * per_state  # fp32 weights 4, fp32 gradients 4, 16-bit gradients 2, the optimizer's states
    total, largest = counts.total, counts.largest_layer
    if stage == 3:
        gathered = 4.0 * largest
        if offload_params:
            return States(0.0, 0.0, 0.0, gathered, host=(rest + 2) * total)
        if offload_optimizer:
            return States(2 * total / ranks, 0.0, 0.0, gathered, host=rest * total)
        # DeepSpeed counts 18 bytes (Adam) here too: the 16-bit weights and gradients and fp32 weights and state
        return States(2 * total / ranks, 2 * total / ranks, (rest - 4) * total / ranks, gathered)
    if offload_optimizer and stage >= 1:
        return States(2.0 * total, 0.0, 0.0, host=rest * total)
    grads = 2 * total / (ranks if stage == 2 else 1)
    fp32 = (rest - 2) * total / (ranks if stage >= 1 else 1)
    return States(2.0 * total, grads, fp32)
