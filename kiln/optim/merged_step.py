"""Param groups whose settings are all equal, stepped as one group.

kiln keeps HF's optimizer layout, two param groups (decayed weights; biases and norm weights without decay),
so that HF and kiln resume each other's checkpoints (`parameter_groups`). With weight_decay 0, the default,
the two groups hold the same settings, yet torch's optimizers do their per-group work twice a step: the
set-up of each group (`_init_group`, the choice of kernel, a profiler range) and, on an accelerator, one
launch of every foreach or fused kernel per group. On the compiled tiny MLP on CPU that second group costs
about 1.6 % of a step (docs/benchmarks.md, "HF's two groups stepped as one").

So, for the duration of `step()` only, the optimizer sees one group that holds every parameter in the groups'
order, with the settings they share; everywhere else `param_groups` is HF's layout, as schedulers, logs,
checkpoints and user code expect. Each parameter's update is the same arithmetic either way: the weights are
bit for bit those of the grouped step.

Where it applies, and why only there:
- torch's own optimizer classes, exactly (a subclass may override `step` and write to its groups, whose
  writes would go to the one-step group and be lost; torch's steps only read them);
- groups with equal settings at this step (a scheduler or a callback may give them different rates later:
  that step runs grouped); a tensor setting (a capturable or compiled learning rate) counts as unequal;
- groups that together hold one kind of tensor: DTensors of one mesh, or plain tensors (a tp plan can leave
  one group all DTensors and the other all plain, and no multi-tensor kernel spans both; kiln/utils/kernels.py);
- no step hooks registered, on the optimizer or globally (a hook would see the one-step group);
- not with a compiled step (`torch_compile_optimizer_step`: the graph is traced once over the real groups),
  nor where a strategy's engine owns the step (DeepSpeed)."""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from kiln.utils.kernels import mixes_meshes

#: torch's optimizers whose `step` reads its param groups and writes only to `state`
_READ_ONLY_GROUPS = tuple(
    getattr(torch.optim, name)
    for name in (
        "Adadelta",
        "Adafactor",
        "Adagrad",
        "Adam",
        "Adamax",
        "AdamW",
        "ASGD",
        "NAdam",
        "RAdam",
        "RMSprop",
        "SGD",
    )
    if hasattr(torch.optim, name)
)


def step_equal_groups_as_one(optimizer: torch.optim.Optimizer | None) -> bool:
    """Install the merged step on `optimizer` (an instance attribute, as torch's LR schedulers install
    theirs); returns whether it did. A no-op for optimizers it does not apply to (see the module docstring)."""
    if (
        optimizer is None
        or type(optimizer) not in _READ_ONLY_GROUPS
        or len(optimizer.param_groups) < 2
        or getattr(optimizer.step, "_kiln_compiled", False)
        or getattr(optimizer.step, "_kiln_merged", False)
    ):
        return False
    inner = optimizer.step  # the bound step, or an LR scheduler's wrapper of it
    ref = weakref.ref(optimizer)  # no cycle: the optimizer holds this function
    one = _OneGroup()

    @functools.wraps(inner)
    def step(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        if opt is None:
            return inner(*args, **kwargs)
        opt._opt_called = True  # type: ignore[attr-defined]  # torch's private marker, not declared on Optimizer; what torch's scheduler wrapper records (a scheduler built later does not wrap this)
        groups = opt.param_groups
        merged = one.of(groups) if not _has_step_hooks(opt) else None
        if merged is None:
            return inner(*args, **kwargs)
        opt.param_groups = merged
        try:
            return inner(*args, **kwargs)
        finally:
            opt.param_groups = groups

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    step._kiln_merged = True  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign]
    return True


class _OneGroup:
    """The one-group view of a list of groups: rebuilt when the groups or their parameter lists change, its
    settings refreshed at every step (a scheduler changes the rate of every group in place)."""

    def __init__(self) -> None:
        self.sources: list[list[Any]] = []
        self.group: dict[str, Any] = {}
        self.view = [self.group]
        self.mixed = False  # the parameters together mix meshes: they step grouped

    def of(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """`[group]` with every parameter, or None when the groups' settings differ or their tensors mix meshes."""
        first = groups[0]
        keys = first.keys()
        for other in groups[1:]:
            if other.keys() != keys:
                return None
            for key, value in first.items():
                theirs = other[key]
                if (
                    key != "params"
                    and theirs is not value
                    and (type(value) is torch.Tensor or type(theirs) is torch.Tensor or theirs != value)
                ):
                    return None
        sources = self.sources
        if (
            len(sources) != len(groups)
            or any(g["params"] is not s for g, s in zip(groups, sources))
            or (len(self.group.get("params", ())) != sum(map(len, sources)))
        ):
            self.sources = sources = [g["params"] for g in groups]
            self.group["params"] = params = [p for params in sources for p in params]
            self.mixed = mixes_meshes(params)
        if self.mixed:
            return None
        group = self.group
        for key, value in first.items():
            if key != "params":
                group[key] = value
        return self.view


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    return bool(
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or torch_optimizer._global_optimizer_pre_hooks
        or torch_optimizer._global_optimizer_post_hooks
    )
