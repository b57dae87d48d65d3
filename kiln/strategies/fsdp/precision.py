"""How the precision plugin's dtypes become FSDP2's: autocast mixed precision is replaced by a
`MixedPrecisionPolicy` (parameters all-gathered in the compute dtype, gradients reduced in fp32),
and fp16's GradScaler by FSDP's `ShardedGradScaler` (its inf check covers every rank's shards).
True half precision (`bf16-true`, `fp16-true`) needs no policy: the half parameters are sharded."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from kiln.precision.base import Precision

log = logging.getLogger(__name__)

_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def fsdp_precision(precision: "Precision", device: torch.device) -> tuple["Precision", Optional[Any]]:
    """The plugin to train with and the MixedPrecisionPolicy for fully_shard (None: no policy)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    compute = precision.compute_dtype
    if compute is None or precision.param_dtype is not None:  # fp32, or true half: nothing to change
        return precision, None
    cls = type(precision)
    # The same plugin (name, loss scaling, skipped-step accounting), minus autocast: FSDP casts.
    substitute = type(f"FSDP{cls.__name__}", (cls,), {
        "forward_context": lambda self: contextlib.nullcontext(),
        "eval_context": lambda self: contextlib.nullcontext(),
    })
    new = substitute.__new__(substitute)
    new.__dict__.update(precision.__dict__)
    if precision.uses_grad_scaler:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        new._scaler = ShardedGradScaler(device=device.type)  # type: ignore[attr-defined]
        new._built_for = None  # type: ignore[attr-defined]
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    log.info("precision %r under FSDP: autocast replaced by MixedPrecisionPolicy(param_dtype=%s, reduce_dtype=fp32)%s.",
             precision.name, _NAMES.get(compute, compute), " and ShardedGradScaler" if precision.uses_grad_scaler else "")
    return new, policy
