"""torch.compile in training: the set-up module (`train.torch_compile*`) and the optimizer step
(`train.torch_compile_optimizer_step`).

The rule the tests hold kiln to (tests/engine/test_compile_*.py, tests/distributed/*compile*): kiln
compiles exactly the graphs, and breaks exactly as often, as a hand-written compiled loop over the
same shapes. Nothing kiln does between forwards (accumulation windows, a short last window, epochs,
evaluation in between) makes dynamo recompile: the module is compiled once per set-up module, the
loop passes tensors (never changing Python numbers) into the forward, and the train/eval switch is
the one a hand-written loop makes too (one graph per mode, each kept in dynamo's cache).

The optimizer step is compiled the way PyTorch's "compiled optimizer" recipe and torchtitan do it:
`torch.compile(optimizer.step)`, installed on the optimizer instance so that every strategy and
precision plug-in that calls `optimizer.step()` (GradScaler's step included) runs the compiled one."""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, cast

import torch
from torch import nn

from kiln.config.compile import compile_kwargs, compiles_blocks, model_compile_kwargs
from kiln.utils.errors import ConfigError

log = logging.getLogger(__name__)


def compile_module(model: nn.Module, strategy: Any, config: Any) -> nn.Module:
    """`model` through torch.compile when the config asks; unchanged when it was compiled already, when
    its blocks were compiled one by one (`torch_compile: {regions: blocks}`, the strategy's
    `setup_compile_regions`) or when the strategy compiled its blocks itself (FSDP2: compiling the sharded
    root on top would trace into FSDP's hooks, a graph break around every unit)."""
    kwargs = model_compile_kwargs(config)
    if (
        kwargs is None
        or hasattr(model, "_orig_mod")
        or compiles_blocks(config)
        or strategy.capabilities.compiles_per_block
    ):
        return model
    # torch.compile of an nn.Module returns an OptimizedModule (an nn.Module); its stub says only Callable
    return cast(nn.Module, torch.compile(model, **kwargs))


def compile_optimizer_step(optimizer: Any, strategy: Any, train: Any) -> None:
    """Replace `optimizer.step` by its compiled form when `train.torch_compile_optimizer_step` is set.

    The compiled step keeps what an LR scheduler's own wrapper of `step` records (`_opt_called`, read
    by its "scheduler stepped before the optimizer" check) and marks itself as wrapped, so a
    scheduler built later (auto_find_batch_size) does not wrap it again: torch's wrapper needs a bound
    method (`step.__func__`), which a compiled function is not."""
    if not train.torch_compile_optimizer_step or optimizer is None:
        return
    if strategy.capabilities.owns_optimizer_step:
        raise ConfigError(
            f"train.torch_compile_optimizer_step cannot be used with strategy {strategy.name!r}: its own "
            "engine runs the optimizer step; drop torch_compile_optimizer_step."
        )
    if getattr(optimizer, "owns_backward", False):
        raise ConfigError(
            f"train.torch_compile_optimizer_step cannot be used with {type(optimizer).__name__}, which "
            "updates the weights inside backward and has no optimizer step to compile; drop the setting."
        )
    if getattr(optimizer.step, "_kiln_compiled", False):  # a second set-up of the same optimizer
        return
    inner = optimizer.step  # a bound method, or an LR scheduler's wrapper of it
    compiled = torch.compile(inner, **compile_kwargs(train))
    ref = weakref.ref(optimizer)  # no cycle: the optimizer holds this function
    # The step sees its learning rates as tensors (PyTorch's compiled-optimizer recipe): a float `lr` that the
    # schedule changes every step is a constant of the traced graph, and dynamo recompiles when it changes (once
    # on CPU, where the second value becomes a symbol; more often on CUDA: 8 graphs where 6 were expected on an
    # H100 with torch 2.11). During the compiled call each group's `lr` is one persistent 0-d tensor filled with
    # the float; outside it the groups hold floats, as everywhere else (schedulers, logs, checkpoints, an eager
    # resume, whose foreach kernels would refuse a tensor lr).
    held: list[torch.Tensor] = []

    @functools.wraps(inner)
    def step(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        if opt is None:
            return compiled(*args, **kwargs)
        opt._opt_called = True  # what torch's scheduler wrapper records, outside the compiled graph
        groups = opt.param_groups
        rates = [group["lr"] for group in groups]
        if len(held) != len(groups):
            held[:] = [torch.zeros((), dtype=torch.float64, device=group["params"][0].device) for group in groups]
        for group, rate, tensor in zip(groups, rates, held):
            if not isinstance(rate, torch.Tensor):  # a user's tensor lr is used as it is
                group["lr"] = tensor.fill_(rate)
        try:
            return compiled(*args, **kwargs)
        finally:
            for group, rate in zip(groups, rates):
                group["lr"] = rate

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    step._kiln_compiled = True  # type: ignore[attr-defined]
    optimizer.step = step
    log.info(
        "The optimizer step of %s runs through torch.compile (backend %r).",
        type(optimizer).__name__,
        compile_kwargs(train)["backend"],
    )
