"""LOMO and AdaLomo (`optim: lomo` / `adalomo`, package `lomo-optim`): optimizers that update each
parameter inside backward, as its gradient appears, so no full set of gradients is ever kept.

They do not fit the usual backward-then-step split: the loss goes to `fused_backward(loss, lr)`,
and with their own gradient clipping (`optim_args: clip_grad_norm=1.0`) `grad_norm(loss)` must run
a first backward before it. kiln's seam for this is general: an optimizer whose `owns_backward` is
true gets the loss through `backward_and_step(loss)` from the strategy's `backward`, and the
strategy's `optimizer_step` leaves it alone (see `Strategy.backward`). The classes here add that
method to LOMO's, using the learning rate the scheduler set on the param group, as HF passes
`learning_rate=self._get_learning_rate()` to `accelerator.backward`.

As in HF, the model is handed to the optimizer (it hooks every parameter), the settings are `lr` plus
`optim_args`, each micro-batch's backward updates the weights (kiln's micro-batch weights scale
the loss, as HF's division by the accumulation steps does), and `max_grad_norm` does not apply: no
gradients are left to clip (use `clip_grad_norm` in optim_args for LOMO's own clipping)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.config.schema.optim import OptimConfig
from kiln.optim.package_optimizers import PackageOptimizer, _package


def _owning_backward(cls: type) -> type:
    """`cls` (Lomo or AdaLomo) with kiln's backward-owning protocol."""

    class OwnsBackward(cls):
        owns_backward = True

        def backward_and_step(self, loss: torch.Tensor) -> None:
            if self.clip_grad_norm is not None and self.clip_grad_norm > 0:
                self.grad_norm(loss)  # a first backward for the clipping coefficient (LOMO's protocol)
            self.fused_backward(loss, self.param_groups[0]["lr"])

        def step(self, closure: Any = None) -> None:  # the update happened inside backward
            return None

    OwnsBackward.__name__ = OwnsBackward.__qualname__ = cls.__name__
    return OwnsBackward


class LomoEntry(PackageOptimizer):
    """Registry entry: LOMO takes the model, not param groups (HF hands it `model=` the same way)."""

    def __call__(self, cfg: OptimConfig) -> tuple[Any, dict[str, Any]]:
        if self.name == "adalomo" and not torch.cuda.is_available():
            raise ValueError(
                "Optimizer 'adalomo' needs a CUDA GPU: lomo-optim's AdaLomo allocates its state with "
                ".cuda(); use optim lomo on the CPU."
            )
        cls = _owning_backward(getattr(_package(self.module, self.pip_name, self.name), self.cls_name))
        return cls, {"lr": cfg.lr}

    def param_groups(
        self, model: nn.Module, cfg: OptimConfig, extra: dict[str, Any], groups: list[dict[str, Any]]
    ) -> Any:
        return model  # LOMO registers a gradient hook on each of the model's parameters


def register(registry: Any) -> None:
    registry.add("lomo", LomoEntry("lomo", "lomo_optim", "lomo-optim", "Lomo", adam=False))
    registry.add("adalomo", LomoEntry("adalomo", "lomo_optim", "lomo-optim", "AdaLomo", adam=False))
