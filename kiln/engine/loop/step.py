"""One optimizer step, top to bottom (`TrainStep.__call__`):

    window = the accumulation window's micro-batches, moved to the device
    weights = each micro-batch's loss weight (None: a lone micro-batch needs none; see loss_weights.py)
    for each micro-batch:
        with strategy.micro_batch_context(model, boundary=last):    # BackwardSyncControl strategies only
            loss = trainer.training_step(model, batch, ...)          # forward, loss x weight, backward
        strategy.on_micro_batch_end()                                # GraphBoundaries strategies only
    result = strategy.optimizer_step(model, optimizer, max_grad_norm)  # unscale, clip, step, skip on inf
    scheduler.step() if result.stepped; strategy.zero_grad(...); strategy.on_step_end()

Every hardware difference is a strategy or precision call; the optional ones are resolved once here
(`isinstance` on the strategy's interfaces), so a strategy without them costs nothing per step. The usual
window, one micro-batch with nothing to weigh, synchronise, cut or guard, calls `training_step` directly:
the per-micro-batch machinery (two context managers, the loop) is about 1 % of a compiled tiny MLP's step on
CPU (docs/benchmarks.md), and it would make exactly that call. An
optimizer that updates the weights inside backward (LOMO, `Run.backward_owner`) gets the loss in
`Trainer.training_step` and leaves nothing for the optimizer step to do.

The micro-batch's place in its window (index, boundary, weights) is passed to `training_step` as
`micro_batch=`. An override with HF's signature, which has no such parameter and calls
`super().training_step(model, inputs, num_items_in_batch)`, finds it in `Run.micro_batch` instead.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from typing import Any, Callable, ContextManager, Optional, Protocol

import torch

from kiln.engine.loop.loss_weights import MicroBatch, WindowWeights
from kiln.engine.loop.step_errors import explain, loss_maker
from kiln.engine.model.facts import ModelFacts
from kiln.engine.run import Run
from kiln.strategies.base import StepResult
from kiln.strategies.interfaces import BackwardSyncControl, GraphBoundaries, StaticShapes

_NULL = contextlib.nullcontext()  # reusable: no new object per micro-batch


def _no_sync_control(model: Any, *, boundary: bool) -> ContextManager[Any]:
    return _NULL


class StepEvents(Protocol):
    """What the fit loop does between the parts of a step (callbacks, the out-of-memory guard)."""

    guarding: bool  # whether `guard` does anything (auto_find_batch_size on one process)

    def guard(self, model: Any) -> ContextManager[Any]: ...

    def substep_end(self) -> None: ...

    def pre_optimizer_step(self) -> None: ...

    def optimizer_step(self) -> None: ...


class TrainStep:
    """Runs optimizer steps for one fit. `training_step` is the Trainer's HF override point."""

    def __init__(self, run: Run, strategy: Any, facts: ModelFacts, config: Any,
                 training_step: Callable[..., torch.Tensor], learning_rate: Callable[[], float], *,
                 wants_num_items: bool) -> None:
        self.run, self.strategy, self.facts = run, strategy, facts
        self.training_step, self.learning_rate = training_step, learning_rate
        self.step_lr = 0.0
        self.wants_num_items = wants_num_items
        self.max_grad_norm = float(config.train.max_grad_norm or 0.0)
        self.global_mean = bool(config.train.average_tokens_across_devices)
        self.static_shapes = isinstance(strategy, StaticShapes)
        self.sync = strategy.micro_batch_context if isinstance(strategy, BackwardSyncControl) else _no_sync_control
        self.cuts: Optional[GraphBoundaries] = strategy if isinstance(strategy, GraphBoundaries) else None
        self.passes_micro_batch = _takes(training_step, "micro_batch")
        self.weighs = self.windows_need_weights(run.accumulation)
        # a lone unweighted micro-batch needs no per-micro-batch context: `training_step` is called directly
        self.direct = self.sync is _no_sync_control and self.cuts is None and self.passes_micro_batch

    def __call__(self, window: list[Any], model: Any, events: "StepEvents") -> tuple[list[torch.Tensor], StepResult]:
        """Forward and backward of every micro-batch of `window`, the optimizer step, the schedule.
        Returns the micro-batches' detached losses (still on the device) and what the step did."""
        run = self.run
        try:  # free until a step raises: see step_errors
            if self.direct and not self.weighs and len(window) == 1 and not events.guarding:
                losses = [self.training_step(model, window[0], num_items_in_batch=None, micro_batch=_LONE)]
            else:
                losses = self.micro_batches(window, model, events)
        except (RuntimeError, TypeError, AttributeError) as err:
            explained = explain(err, window[0], loss_maker(self.training_step, run.model, self.facts.training_module),
                                run.model)
            if explained is None:
                raise
            raise explained from err
        events.pre_optimizer_step()
        result = self.optimizer_step(model)
        events.optimizer_step()
        self.step_lr = self.learning_rate()  # the rate this step used: logged as learning_rate (HF), not the next one's
        if result.stepped and run.scheduler is not None and not run.scheduler_needs_metrics:
            run.scheduler.step()
        self.strategy.zero_grad(model, run.optimizer)
        if self.cuts is not None:
            self.cuts.on_step_end()
        return losses, result

    def micro_batches(self, window: list[Any], model: Any, events: "StepEvents") -> list[torch.Tensor]:
        """Forward and backward of each micro-batch of `window`, in its context; returns the detached losses."""
        run = self.run
        weights = self.loss_weights(window) if self.weighs else None
        num_items = weights.total if weights is not None and self.wants_num_items else None
        losses = []
        last = len(window) - 1
        with events.guard(model):  # auto_find_batch_size: out of memory in here redoes the window smaller
            for i, batch in enumerate(window):
                micro = _LONE if last == 0 and weights is None else MicroBatch(i, i == last, weights)
                with self.sync(model, boundary=micro.boundary):
                    if self.passes_micro_batch:
                        losses.append(self.training_step(model, batch, num_items_in_batch=num_items, micro_batch=micro))
                    else:
                        run.micro_batch = micro
                        losses.append(self.training_step(model, batch, num_items_in_batch=num_items))
                if self.cuts is not None:
                    self.cuts.on_micro_batch_end()
                if i < last:
                    events.substep_end()
            run.micro_batch = None
        return losses

    def optimizer_step(self, model: Any) -> StepResult:
        """The strategy's optimizer step (or, for a backward-owning optimizer, its no-op step, which
        the scheduler's step counter still expects first)."""
        run = self.run
        if run.backward_owner is not None:
            run.optimizer.step()  # type: ignore[union-attr]
            return StepResult(True, None)
        return self.strategy.optimizer_step(model, run.optimizer, self.max_grad_norm)

    # -- loss weights -------------------------------------------------------------------------
    def windows_need_weights(self, micro_batches: int) -> bool:
        """Whether `loss_weights` can return weights for windows of up to `micro_batches` micro-batches
        (False: a lone micro-batch on one shard, or shards that average their own means, and a model
        that takes no item count). Asked once per fit instead of building every window's weights."""
        s = self.strategy
        return micro_batches > 1 or (s.item_shards > 1 and self.global_mean) or self.facts.accepts_num_items

    def loss_weights(self, window: list[Any]) -> Optional[WindowWeights]:
        """Per-micro-batch loss weights for this window (None: one micro-batch on one shard, whose
        mean loss needs no weighting). See kiln.engine.loop.loss_weights."""
        s = self.strategy
        # static shapes: a short window is weighed like a full one whose missing micro-batches count zero
        # items (zeros uploaded like the other counts, so its first micro-batch replays a full window's graph)
        slots = self.run.accumulation if self.static_shapes else len(window)
        if slots == 1 and not self.windows_need_weights(1):
            return None
        raw = [self.facts.count_items(b) for b in window] + [0] * (slots - len(window))
        if any(isinstance(c, torch.Tensor) for c in raw):
            counts = [torch.as_tensor(c, device=s.root_device) for c in raw]
        else:  # one upload for the window (XLA would make a 0-dim 0 or 1 a graph constant, not an input)
            counts = list(torch.tensor(raw, device=s.root_device).unbind())
        return WindowWeights.for_window(counts, item_shards=s.item_shards, grad_divisor=s.grad_divisor,
                                        global_mean=self.global_mean, model_divides=self.facts.model_divides(window[0]),
                                        reduce_async=s.reduce_async)


def _takes(method: Callable[..., Any], name: str) -> bool:
    """Whether `method` accepts the keyword `name` (by name or through **kwargs)."""
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def batch_tokens(batch: Any) -> int:
    """The `input_ids` tokens of a dict batch (0 for anything else)."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    return ids.numel() if isinstance(ids, torch.Tensor) else 0


_LONE = MicroBatch(0, True, None)  # the usual window's one unweighted micro-batch: no new object a step
