"""One optimizer step as the data flows (`TrainStep.__call__`, then `Trainer.training_step` per micro-batch):

    weights = loss_weights(window)            # each micro-batch's share of the window's items (loss_weights.py)
    with events.guard(model):                 # auto_find_batch_size: out of memory redoes the window smaller
        for micro, batch in window:           # or, for an OwnsMicroBatchWindow strategy (a pipeline schedule):
                                              #   losses = strategy.run_window(model, window, weights)
            with strategy.micro_batch_context(model, boundary=micro.boundary):   # [BackwardSyncControl]
                Trainer.training_step(model, batch, num_items_in_batch):
                    with precision.forward_context():                    # autocast for mixed precision
                        loss = compute_loss(model, batch) * micro.weight
                    strategy.backward(loss, model, boundary=...)         # precision.backward: loss scaling
            strategy.on_micro_batch_end()                                # [GraphBoundaries]
    result = strategy.optimizer_step(model, optimizer, max_grad_norm)  # unscale, clip, step, skip on inf/nan
    scheduler.step() if result.stepped; strategy.zero_grad(model, optimizer); strategy.on_step_end()

Every hardware difference is a strategy or precision call; the optional ones are resolved once here
(`isinstance` on the strategy's interfaces, kiln/strategies/interfaces.py), so a strategy without them costs
nothing per step and the loop has no branch for any of them: `forward_backward` is either the
per-micro-batch loop or the window-owning strategy's `run_window`, chosen when the step is built. An
optimizer that updates the weights inside backward (LOMO, `Run.backward_owner`) gets the loss in
`Trainer.training_step` and leaves nothing for the optimizer step to do.

`training_step` is called at one place, with HF's signature; the micro-batch's place in its window (index,
boundary, weights) is `Run.micro_batch` while it runs, so an override that calls
`super().training_step(model, inputs, num_items_in_batch)` weighs exactly too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from kiln.engine.loop.loss_weights import MicroBatch, WindowWeights
from kiln.engine.loop.step_errors import explain, loss_maker, refuse_per_micro_batch_overrides
from kiln.engine.model.facts import ModelFacts
from kiln.engine.run import Run
from kiln.strategies.base import StepResult
from kiln.strategies.interfaces import BackwardSyncControl, GraphBoundaries, OwnsMicroBatchWindow

_NULL = contextlib.nullcontext()  # reusable: no new object per micro-batch


def _no_sync_control(model: Any, *, boundary: bool) -> AbstractContextManager[Any]:
    return _NULL


class StepEvents(Protocol):
    """What the fit loop does between the parts of a step (callbacks, the out-of-memory guard)."""

    guarding: bool  # whether `guard` does anything (auto_find_batch_size on one process)

    def guard(self, model: Any) -> AbstractContextManager[Any]: ...

    def substep_end(self) -> None: ...

    def pre_optimizer_step(self) -> None: ...

    def optimizer_step(self) -> None: ...


class TrainStep:
    """Runs optimizer steps for one fit. `training_step` is the Trainer's HF override point."""

    def __init__(
        self,
        run: Run,
        strategy: Any,
        facts: ModelFacts,
        config: Any,
        training_step: Callable[..., torch.Tensor],
        learning_rate: Callable[[], float],
        *,
        wants_num_items: bool,
    ) -> None:
        self.run, self.strategy, self.facts = run, strategy, facts
        self.training_step, self.learning_rate = training_step, learning_rate
        self.step_lr = 0.0
        self.wants_num_items = wants_num_items
        self.max_grad_norm = float(config.train.max_grad_norm or 0.0)
        self.global_mean = bool(config.train.average_tokens_across_devices)
        self.static_shapes = strategy.capabilities.static_shapes
        self.sync = strategy.micro_batch_context if isinstance(strategy, BackwardSyncControl) else _no_sync_control
        self.cuts: GraphBoundaries | None = strategy if isinstance(strategy, GraphBoundaries) else None
        self.weighs = self.windows_need_weights(run.accumulation)
        #: forward and backward of a window: the per-micro-batch loop, or a strategy that owns the window
        self.forward_backward = self.micro_batches
        if isinstance(strategy, OwnsMicroBatchWindow):
            refuse_per_micro_batch_overrides(training_step, run, self.strategy.name, strategy.loss_source)
            self.owner: OwnsMicroBatchWindow = strategy
            self.forward_backward = self.owned_window

    def __call__(self, window: list[Any], model: Any, events: StepEvents) -> tuple[list[torch.Tensor], StepResult]:
        """Forward and backward of every micro-batch of `window`, the optimizer step, the schedule.
        Returns the micro-batches' detached losses (still on the device) and what the step did."""
        run, strategy = self.run, self.strategy
        try:  # free until a step raises: see step_errors
            weights = self.loss_weights(window) if self.weighs else None
            with events.guard(model):  # auto_find_batch_size: out of memory in here redoes the window smaller
                losses = self.forward_backward(model, window, weights, events)
        except (RuntimeError, TypeError, AttributeError) as err:
            explained = explain(
                err, window[0], loss_maker(self.training_step, run.model, self.facts.training_module), run.model
            )
            if explained is None:
                raise
            raise explained from err
        events.pre_optimizer_step()
        result = self.optimizer_step(model)  # unscale, clip, step; skipped on inf/nan gradients
        events.optimizer_step()
        self.step_lr = self.learning_rate()  # the rate this step used: logged as learning_rate (HF), not the next one's
        if result.stepped and run.scheduler is not None and not run.scheduler_needs_metrics:
            run.scheduler.step()
        strategy.zero_grad(model, run.optimizer)
        if self.cuts is not None:
            self.cuts.on_step_end()
        return losses, result

    def micro_batches(
        self, model: Any, window: list[Any], weights: WindowWeights | None, events: StepEvents
    ) -> list[torch.Tensor]:
        """Forward and backward of each micro-batch of `window` in its synchronisation context, through
        `training_step` (which reads its place in the window from `Run.micro_batch`); the detached losses."""
        run = self.run
        num_items = weights.total if weights is not None and self.wants_num_items else None
        losses = []
        last = len(window) - 1
        for i, batch in enumerate(window):
            run.micro_batch = micro = _LONE if last == 0 and weights is None else MicroBatch(i, i == last, weights)
            with self.sync(model, boundary=micro.boundary):
                losses.append(self.training_step(model, batch, num_items_in_batch=num_items))
            if self.cuts is not None:
                self.cuts.on_micro_batch_end()
            if i < last:
                events.substep_end()
        run.micro_batch = None
        return losses

    def owned_window(
        self, model: Any, window: list[Any], weights: WindowWeights | None, events: StepEvents
    ) -> list[torch.Tensor]:
        """The window run by a strategy that owns it (`OwnsMicroBatchWindow`: a pipeline schedule);
        `on_substep_end` still fires once per micro-batch but the last, after the window."""
        losses = self.owner.run_window(model, window, weights)
        for _ in range(len(window) - 1):
            events.substep_end()
        return losses

    def optimizer_step(self, model: Any) -> StepResult:
        """The strategy's optimizer step (or, for a backward-owning optimizer, its no-op step, which
        the scheduler's step counter still expects first)."""
        run = self.run
        if run.backward_owner is not None:
            run.optimizer.step()  # type: ignore[union-attr]
            return StepResult(True, None)
        result: StepResult = self.strategy.optimizer_step(model, run.optimizer, self.max_grad_norm)
        return result

    # -- loss weights -------------------------------------------------------------------------
    def windows_need_weights(self, micro_batches: int) -> bool:
        """Whether `loss_weights` can return weights for windows of up to `micro_batches` micro-batches
        (False: a lone micro-batch on one shard, or shards that average their own means, and a model
        that takes no item count). Asked once per fit instead of building every window's weights."""
        s = self.strategy
        return micro_batches > 1 or (s.item_shards > 1 and self.global_mean) or self.facts.accepts_num_items

    def loss_weights(self, window: list[Any]) -> WindowWeights | None:
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
        return WindowWeights.for_window(
            counts,
            item_shards=s.item_shards,
            grad_divisor=s.grad_divisor,
            global_mean=self.global_mean,
            model_divides=self.facts.model_divides(window[0]),
            reduce_async=s.reduce_async,
        )


def batch_tokens(batch: Any) -> int:
    """The `input_ids` tokens of a dict batch (0 for anything else)."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    return ids.numel() if isinstance(ids, torch.Tensor) else 0


_LONE = MicroBatch(0, True, None)  # the usual window's one unweighted micro-batch: no new object a step
