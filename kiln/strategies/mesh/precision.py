"""How the precision plugin's dtypes become the mesh strategy's. Where FSDP2 shards the model,
autocast mixed precision is replaced by a `MixedPrecisionPolicy` (parameters all-gathered in the
compute dtype, gradients reduced in fp32); where tensor parallelism alone splits it, autocast stays
(it casts the TP layers' DTensor inputs like tensors). Either way fp16's GradScaler becomes
`ShardedLocalGradScaler` (grad_scaler.py), whose inf check covers every rank's gradients. True half precision
(`bf16-true`, `fp16-true`) needs nothing: the half parameters are what gets sharded or split."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kiln.precision.base import Precision

log = logging.getLogger(__name__)

_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def mesh_precision(precision: Precision, device: torch.device, fsdp: bool) -> tuple[Precision, Any | None]:
    """The plugin to train with and the MixedPrecisionPolicy for fully_shard (None: no policy).
    `fsdp`: FSDP2 shards the model (else tensor parallelism alone splits it, and autocast stays)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    compute = precision.compute_dtype
    if compute is None or precision.param_dtype is not None:  # fp32, or true half: nothing to change
        return precision, None
    if not fsdp and not precision.uses_grad_scaler:  # bf16 autocast under tp alone: as it is
        return precision, None
    cls = type(precision)
    new: Any
    if fsdp:  # the same plugin (name, loss scaling, skipped-step accounting), minus autocast: FSDP casts
        substitute = type(
            f"FSDP{cls.__name__}",
            (cls,),
            {
                "forward_context": lambda self: contextlib.nullcontext(),
                "eval_context": lambda self: contextlib.nullcontext(),
                "sharded_by_fsdp": True,
            },
        )
        new = object.__new__(substitute)  # no precision plugin defines __new__
        new.__dict__.update(precision.__dict__)
    else:
        new = precision
    if precision.uses_grad_scaler:
        from kiln.strategies.mesh.grad_scaler import ShardedLocalGradScaler

        new._scaler = ShardedLocalGradScaler(device=device.type)
        new._built_for = None
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if fsdp else None
    scaler = " and ShardedLocalGradScaler" if precision.uses_grad_scaler else ""
    if fsdp:
        log.info(
            "precision %r under FSDP: autocast replaced by MixedPrecisionPolicy(param_dtype=%s, reduce_dtype=fp32)%s.",
            precision.name,
            _NAMES.get(compute, compute),
            scaler,
        )
    else:
        log.info("precision %r under tensor parallelism: autocast%s.", precision.name, scaler)
    return new, policy
