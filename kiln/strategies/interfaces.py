"""What only some strategies do: optional interfaces a strategy opts into by inheriting them.

The required core lives in `kiln/strategies/base.py`. Everything here is asked for by the engine with
`isinstance(strategy, <Interface>)` once, at set-up, never by a strategy's name; a strategy that does
not inherit an interface simply has nothing to do at that point (no no-op hook is called per step).

- `BackwardSyncControl`: the strategy decides around each micro-batch whether gradients are
  synchronised (DDP's `no_sync`, FSDP2's `set_requires_gradient_sync`, DeepSpeed's boundary).
- `GraphBoundaries`: the strategy cuts a lazily recorded graph after each micro-batch and after
  each optimizer step (XLA's `torch_xla.sync()`).
- `ShardedModuleInit`: a model the Trainer builds itself is built inside the strategy's context
  (the mesh strategy's meta device / rank-0 loading, DeepSpeed's `zero.Init`).
- `OwnsMicroBatchWindow`: the strategy runs the forward and backward of a whole accumulation window
  itself, in its own order (a pipeline schedule: GPipe, 1F1B), and hands back the micro-batches' losses.
- `ReportsStepFigures`: the strategy has figures of its own for the loggers on logging steps (expert
  parallelism's tokens per expert).

What a strategy only declares, with no method to call (static shapes, an optimizer step its own engine
owns, compiling per block), is a field of its `Capabilities` (kiln/strategies/capabilities.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Protocol

import torch
from torch import nn


class BackwardSyncControl(ABC):
    """Gradient synchronisation decided per micro-batch.

    The loop wraps each micro-batch's forward *and* backward in `micro_batch_context(model,
    boundary=...)`; `boundary` is True for the last micro-batch of an accumulation window. DDP decides
    at forward time whether its backward all-reduces, so the context must open before the forward."""

    @abstractmethod
    def micro_batch_context(self, model: nn.Module, *, boundary: bool) -> AbstractContextManager[Any]:
        """Around one micro-batch's forward and backward (skip the reduction unless `boundary`)."""


class GraphBoundaries(ABC):
    """A strategy that records operations lazily and runs them as one graph per cut (XLA).

    The loop calls `on_micro_batch_end()` after each micro-batch's backward and `on_step_end()` after
    each optimizer step and zero_grad, so every step replays the same few compiled graphs."""

    @abstractmethod
    def on_micro_batch_end(self) -> None:
        """After each micro-batch's backward."""

    @abstractmethod
    def on_step_end(self) -> None:
        """After each optimizer step and zero_grad."""


class ShardedModuleInit(ABC):
    """A model the Trainer creates itself (`model_init`, a config-named class) is built inside
    `module_init_context()`: on the meta device, on rank 0 only, or partitioned as it is created, so
    a model larger than one process's memory can be built at all."""

    @abstractmethod
    def module_init_context(self) -> AbstractContextManager[Any]:
        """The context the Trainer builds the model in (may be a null context for some settings)."""


class LossWeights(Protocol):
    """What a window-owning strategy reads of the window's loss weights (the engine's `WindowWeights`,
    kiln/engine/loop/loss_weights.py)."""

    #: the model divides its summed loss by `total` itself (HF's `num_items_in_batch`)
    model_divides: bool

    @property
    def total(self) -> torch.Tensor:
        """The items the window's loss averages over (HF's `num_items_in_batch`)."""

    def weight(self, i: int) -> Any:
        """The factor for micro-batch i's loss (None: leave it as it is)."""


class OwnsMicroBatchWindow(ABC):
    """A strategy that runs a whole accumulation window itself, as a pipeline schedule does: the
    micro-batches are the schedule's, interleaved across stages (GPipe: every forward, then every
    backward; 1F1B: alternating), so no per-micro-batch loop outside the strategy could drive them.

    The step calls `run_window` once per optimizer step in place of its per-micro-batch loop; the
    optimizer step (`optimizer_step`, whose clipping must be global across the strategy's stages),
    the scheduler and `zero_grad` stay the engine's, as for every strategy. The contract:

    - `window` holds the window's micro-batches in order, each already through `batch_to_device`.
    - When it returns, each trained parameter's gradient is the sum over micro-batches i of the
      gradient of `loss_i * w_i`: `loss_i` is micro-batch i's loss as the model computes it (the mean
      over its items; HF-contract models that take `num_items_in_batch` are given `weights.total`, and
      divide by it themselves, when `weights.model_divides`), and `w_i = weights.weight(i)`, left out
      where `weights` is None (a lone micro-batch on one item shard: its mean needs no weight) or the
      weight is None. The weights carry kiln's item-count rule (kiln/engine/loop/loss_weights.py:
      `num_items_in_batch`, `average_tokens_across_devices`); `weights.total` is the window's item
      count, summed over the item shards when averaged across devices.
    - Gradients are synchronised across data-parallel replicas by the strategy (the window's end is
      the only boundary), and its forwards run in `self.precision.forward_context()`, its backwards
      through `self.precision.backward` (loss scaling).
    - It returns one detached loss per micro-batch, `loss_i * w_i` as `Trainer.training_step` returns
      it, on every rank (a stage that computes no loss receives them from the one that does), since
      every rank logs them and stops on non-finite ones alike.

    The Trainer's per-micro-batch override points (`training_step`, `compute_loss`) cannot run inside a
    schedule, so a Trainer that overrides them is refused when the fit starts, as is an optimizer that
    updates the weights inside backward (LOMO); the refusal names `loss_source`, where the loss comes
    from instead."""

    #: where the window's losses come from, named by the refusal of a per-micro-batch override
    loss_source: ClassVar[str] = "the model's forward (its 'loss' output)"

    @abstractmethod
    def run_window(self, model: nn.Module, window: list[Any], weights: LossWeights | None) -> list[torch.Tensor]:
        """Forward and backward of every micro-batch of `window`; their detached weighted losses. Their
        values may be completed in place by the strategy's `optimizer_step` (a pipeline's first stages get
        them from the last stage in the step's collectives): the loop reads them only after that step."""


class ReportsStepFigures(ABC):
    """A strategy with figures of its own for the loggers (beside throughput), gathered on device while
    training and read only on logging steps."""

    @abstractmethod
    def step_figures(self, steps: int) -> dict[str, float]:
        """Figures for the `steps` optimizer steps since the last logging step; a collective where the
        strategy has several processes (every rank calls it on the same logging steps)."""


__all__ = [
    "BackwardSyncControl",
    "GraphBoundaries",
    "LossWeights",
    "OwnsMicroBatchWindow",
    "ReportsStepFigures",
    "ShardedModuleInit",
]
