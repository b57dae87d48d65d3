"""DDP's `find_unused_parameters`, chosen on the first step when the user leaves it unset.

HF's default (True) makes DDP walk the autograd graph every step (+30% step time for a small MLP on
CPU) and prints torch's multi-line warning from every process when nothing is unused; False makes a
model with unused parameters fail on its second step after a wrong first one. So kiln wraps with
False and runs the first window's last micro-batch without DDP's reduction (`no_sync`); then:

- every rank reports which parameters received a gradient (one small all-reduce);
- the step's gradients are averaged by hand, exactly as DDP would have (a missing gradient of a
  parameter that another rank used counts as zero), so the first step is correct either way;
- if some parameter got no gradient anywhere-or-somewhere, the DDP wrapper is rebuilt in place with
  find_unused_parameters=True; otherwise it stays off. One line on rank 0 says which.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def trainable(ddp: nn.parallel.DistributedDataParallel) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in ddp.module.named_parameters() if p.requires_grad]


def average_first_step(ddp: nn.parallel.DistributedDataParallel, world_size: int) -> list[str]:
    """Average the gradients over ranks as DDP does; returns the names of parameters that some rank
    left without a gradient (empty: nothing unused)."""
    params = trainable(ddp)
    device = params[0][1].device if params else torch.device("cpu")
    used = torch.tensor([p.grad is not None for _, p in params], dtype=torch.uint8, device=device)
    used_anywhere, used_everywhere = used.clone(), used.clone()
    dist.all_reduce(used_anywhere, op=dist.ReduceOp.MAX, group=ddp.process_group)
    dist.all_reduce(used_everywhere, op=dist.ReduceOp.MIN, group=ddp.process_group)
    for (_, p), anywhere in zip(params, used_anywhere.tolist()):
        if not anywhere:  # unused on every rank: DDP leaves such a gradient untouched
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.div_(world_size)  # DDP divides before it sums
        dist.all_reduce(p.grad, group=ddp.process_group)
    # names as the user's module has them (kiln wraps a TrainingModule in a dispatcher holding it as `module`)
    return [name.removeprefix("module.") for (name, _), every in zip(params, used_everywhere.tolist()) if not every]


def rebuild_with_find_unused(ddp: nn.parallel.DistributedDataParallel, make: Callable[[nn.Module], Any]) -> None:
    """Turn find_unused_parameters on for an existing wrapper (the loop holds a reference to it):
    build a new one around the same module, drop the old reducer's gradient hooks, adopt its state."""
    fresh = make(ddp.module)
    ddp.reducer._remove_autograd_hooks()  # otherwise both reducers would react to every gradient
    ddp.__dict__.update(fresh.__dict__)


@contextlib.contextmanager
def first_boundary(
    ddp: nn.parallel.DistributedDataParallel,
    world_size: int,
    make: Callable[[nn.Module], Any],
    say: Callable[[str], None],
) -> Iterator[None]:
    """The first window's last micro-batch: backward without DDP's reduction, then decide."""
    with ddp.no_sync():
        yield
    unused = average_first_step(ddp, world_size)
    if unused:
        rebuild_with_find_unused(ddp, make)
        shown = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
        say(
            f"DDP: {len(unused)} parameter(s) got no gradient in the first step ({shown}); find_unused_parameters "
            "is on (set strategy.find_unused_parameters: false if they are frozen by mistake)"
        )
    else:
        say(
            "DDP: every parameter got a gradient in the first step; find_unused_parameters is off "
            "(set strategy.find_unused_parameters: true if later steps leave some out)"
        )
