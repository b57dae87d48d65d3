"""Adam and AdamW stepping DTensor parameters through their local shards.

The expert weights of an ep (expert-parallel) mesh stay DTensors, and so does their optimizer state, so that
checkpoints save and reshard them. Yet every op of torch's Adam kernels on a DTensor goes through DTensor's
dispatch (sharding propagation, then the same op on the local shard): on the ep 2 Mixtral of
bench/model_parallel_overhead.py that was about 1 ms of a 4.5 ms optimizer step on the CPU, for four tensors.

An elementwise op on DTensors that share one mesh, placements and shape runs exactly that op on their local
shards, so handing the kernel the local shards makes the same update, bit for bit, while the state keeps
being built and stored as DTensors (torch builds it in `_init_group` from the DTensor parameter, as before;
the kernel then updates its local shard in place). So `_init_group` runs as torch wrote it, and its lists
then get each DTensor's local shard in place of the DTensor.

Where it applies, and why only there:
- torch's Adam and AdamW exactly (their step hands `_init_group`'s lists to a kernel of elementwise ops;
  a subclass may do anything with them);
- not with a compiled step (`torch_compile_optimizer_step`), nor where a strategy's engine owns the step
  (DeepSpeed);
- groups without the fused kernel (whose grad scaling and inf check read the tensors as a whole) and not
  differentiable (the local shards are not in the DTensors' autograd graph);
- a group's tensors are swapped only if every DTensor parameter's gradient and state share the parameter's
  mesh, placements and shape (a Partial gradient, or state loaded in another layout, would need DTensor's
  redistribution); otherwise the group steps as before, DTensors and all."""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

import torch


def step_dtensors_locally(optimizer: torch.optim.Optimizer | None) -> bool:
    """Install the local-shard stepping on `optimizer` (an instance attribute over its `_init_group`);
    returns whether it did. A no-op for optimizers it does not apply to (see the module docstring)."""
    if (
        optimizer is None
        or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW)
        or getattr(optimizer.step, "_kiln_compiled", False)  # the graph is traced over torch's own _init_group
    ):
        return False
    if not _holds_dtensors(optimizer):  # nothing to swap: a plain run's step stays torch's, without the scan
        return False
    # torch's private helper: a torch without it keeps its own step, rather than a run that fails
    own = getattr(type(optimizer), "_init_group", None)
    if own is None or getattr(optimizer._init_group, "_kiln_local", False):  # type: ignore[attr-defined]
        return False
    ref = weakref.ref(optimizer)  # no cycle: the optimizer holds this function

    @functools.wraps(own)
    def init_group(group: dict[str, Any], *lists: list[torch.Tensor]) -> Any:
        result = own(ref(), group, *lists)
        if not group["fused"] and not group["differentiable"]:
            _to_local_shards(*lists)
        return result

    init_group._kiln_local = True  # type: ignore[attr-defined]
    optimizer._init_group = init_group  # type: ignore[attr-defined]
    return True


def _holds_dtensors(optimizer: torch.optim.Optimizer) -> bool:
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor was ever made in this process
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])


def _to_local_shards(params: list[torch.Tensor], *others: list[torch.Tensor]) -> None:
    """Replace, in place, each DTensor of `params` and of the lists that follow it (Adam's gradients,
    exp_avgs, exp_avg_sqs, max_exp_avg_sqs, then the plain step counts, each listed per parameter with a
    gradient, in `params`' order) by its local shard, if every one of them has its parameter's layout
    (`_spec`: mesh, placements, shape, stride, dtype); otherwise leave every list as it is."""
    from torch.distributed.tensor import DTensor  # here: a second of import that a run without DTensors never pays

    # max_exp_avg_sqs is empty without amsgrad; the step counts are plain 0-dim tensors, never DTensors
    per_param = [lst for lst in others[:-1] if len(lst) == len(params)]
    for i, p in enumerate(params):
        if isinstance(p, DTensor):
            for lst in per_param:
                t = lst[i]
                if not isinstance(t, DTensor) or t._spec != p._spec:
                    return
        elif any(isinstance(lst[i], DTensor) for lst in per_param):
            return
    for lst in (params, *per_param):
        for i, t in enumerate(lst):
            if isinstance(t, DTensor):
                lst[i] = t._local_tensor  # the shard itself (to_local() would add an autograd node)
