"""Gradients that stay allocated between steps on XLA devices (`XLAStrategy.persistent_gradients`).

XLA compiles one graph per distinct recorded computation. With gradients set to None after each
step, a window's first backward creates them (one graph) and the later ones add to them (another),
and the optimizer step is compiled once more for gradients coming out of each: an epoch's short last
window (one micro-batch) then compiles anew, and a resumed run, whose gradients start out different
from the uninterrupted run's, compiles and rounds its first step differently (the SPMD resume that
was 1.9e-9 off). So every trainable parameter gets a zero gradient, sharded like the parameter, when
training is set up, and `zero_grad` zeroes in place.

Parameters that no backward reaches (a head the loss does not use) would then be stepped with a zero
gradient, which decoupled weight decay still shrinks: the first optimizer step drops their gradients
again, so they stay untouched, as with None gradients. A parameter that gets a gradient in some
steps and not in others is stepped with a zero gradient in the others, as `zero_grad(set_to_none=False)`
does anywhere.
"""

from __future__ import annotations

from typing import Any

import torch


class PersistentGradients:
    def __init__(self) -> None:
        self._reached: set[int] = set()
        self._hooks: list[Any] = []
        self._params: list[torch.Tensor] = []

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Give every trainable parameter a zero gradient (device data at once) and watch which
        ones the first backward reaches."""
        import torch_xla

        self.detach()
        self._params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        for param in self._params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
                sharding = torch_xla._XLAC._get_xla_op_sharding(param)
                if sharding:
                    torch_xla._XLAC._xla_mark_sharding(param.grad, sharding)
            self._hooks.append(param.register_post_accumulate_grad_hook(self._reach))
        torch_xla.sync()

    def _reach(self, param: torch.Tensor) -> None:
        self._reached.add(id(param))

    def settle(self) -> None:
        """Before the first optimizer step (after any checkpoint load, which may have given every
        parameter a zero gradient again): drop the gradients of parameters no backward reached."""
        if not self._hooks:
            return
        for param in self._params:
            if id(param) not in self._reached:
                param.grad = None
        self.detach()

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._reached = [], set()
