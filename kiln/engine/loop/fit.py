"""The fit loop: epochs, accumulation windows, optimizer steps and the log/eval/save cadence.

The loop receives what it works with as arguments: the Run (model, optimizer, scheduler, live
sizes), the strategy, the precision plugin, the callbacks, the checkpoint manager, the config, and
the Trainer only as `TrainerHooks` (HF's override points: get_train_dataloader, training_step, log,
...). One optimizer step is `TrainStep.__call__` (loop/step.py), readable top to bottom; the running
loss sums are `RunningLoss` (loop/running_loss.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from kiln.engine.callbacks.base import interval
from kiln.engine.checkpoint.data_position import resume_iterator
from kiln.engine.data.epoch_rng import EpochRandomState
from kiln.engine.data.loaders import loader_length, set_epoch
from kiln.engine.loop.batch_size import (
    evaluation_out_of_memory,
    find_batch_size,
    free_memory,
    restart_smaller,
    saved_batch_size,
)
from kiln.engine.loop.fit_evaluation import evaluate_during_training
from kiln.engine.loop.fit_meter import FitMeter
from kiln.engine.loop.loss_reads import NonFiniteGuard
from kiln.engine.loop.oom_recovery import OomRecovery, WindowOutOfMemory
from kiln.engine.loop.plan import plan_steps
from kiln.engine.loop.preemption import Preemption
from kiln.engine.loop.running_loss import RunningLoss, mean_over_ranks
from kiln.engine.loop.step import TrainStep
from kiln.engine.loop.summary import log_training_start
from kiln.engine.run import setup_for_training
from kiln.engine.seed import set_rng_state
from kiln.optim.optimizers import optimizer_mode

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from kiln.engine.callbacks.base import CallbackHandler
    from kiln.engine.callbacks.state import TrainerControl
    from kiln.engine.checkpoint.manager import CheckpointManager
    from kiln.engine.hooks import TrainerHooks
    from kiln.engine.run import Run
    from kiln.precision.base import Precision
    from kiln.strategies.base import Strategy


class TrainOutput(tuple[Any, ...]):
    """(global_step, training_loss, metrics), with attribute access as in HF."""

    def __new__(cls, global_step: int, training_loss: float, metrics: dict[str, float]) -> TrainOutput:
        return super().__new__(cls, (global_step, training_loss, metrics))

    global_step = property(lambda self: self[0])
    training_loss = property(lambda self: self[1])
    metrics = property(lambda self: self[2])

    def __repr__(self) -> str:
        return f"TrainOutput(global_step={self[0]}, training_loss={self[1]:.6g}, metrics={self[2]})"


class FitLoop:
    def __init__(
        self,
        hooks: TrainerHooks,
        run: Run,
        strategy: Strategy,
        precision: Precision,
        callbacks: CallbackHandler,
        checkpoints: CheckpointManager,
        config: Any,
        memory_tracker: Any,
        *,
        wants_num_items: bool,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> None:
        self.hooks, self.run, self.strategy, self.precision = hooks, run, strategy, precision
        self.callbacks, self.checkpoints, self.config, self.memory_tracker = (
            callbacks,
            checkpoints,
            config,
            memory_tracker,
        )
        self.wants_num_items = wants_num_items
        self.ignore_keys_for_eval = ignore_keys_for_eval  # fit()'s, for every evaluation during training
        self._rng: dict[str, Any] | None = None  # a resumed run's RNG streams, set right before its first batch
        self.restarted = False  # auto_find_batch_size restarted the fit with a smaller batch (restart_smaller)

    def run_fit(self, resume_path: str | None) -> TrainOutput:
        with Preemption(self.strategy, bool(self.config.save.on_preemption)) as self.preemption:
            while True:  # auto_find_batch_size: out of memory outside a window restarts smaller, as HF (batch_size.py)
                try:
                    return self._run(resume_path)
                except Exception as err:
                    if not restart_smaller(self, err, resume_path):
                        self._ending_with(err)
                        raise
                free_memory(self.strategy)

    def _ending_with(self, err: Exception) -> None:
        """`on_exception` before the error leaves the fit (a callback may add a note to it); a callback that
        fails here is logged, never raised over the error that ends the run."""
        try:
            self._event("on_exception", exception=err)
        except Exception:  # noqa: BLE001 - the run's own error is the one to raise
            log.exception("A callback's on_exception failed while the fit was ending with %s.", type(err).__name__)

    def _run(self, resume_path: str | None) -> TrainOutput:
        hooks, run, cfg, strategy = self.hooks, self.run, self.config, self.strategy
        loader = self._train_dataloader(resume_path)
        self.checkpoints.attach(self, loader)  # the loop's sums and the data position go into checkpoints
        batches_per_epoch = loader_length(loader)
        max_steps, num_epochs, updates_per_epoch = plan_steps(cfg, run.accumulation, batches_per_epoch)
        if max_steps <= 0:  # HF trains 0 steps and reports success; a config for evaluate/predict may say 0
            raise ValueError(
                "train.num_train_epochs is 0 and train.max_steps is unset, so fit() would train nothing: set "
                "num_train_epochs > 0 or max_steps > 0 (to score a model without training, use evaluate)."
            )
        setup_for_training(
            run, strategy, self.precision, cfg, hooks.create_optimizer, hooks.create_scheduler, max_steps
        )
        self._show_callbacks(loader)
        restored = self.checkpoints.load(resume_path) if resume_path else None
        if restored is not None:
            run.state, self._rng = restored.state, restored.rng
        state = run.state
        state.max_steps, state.num_train_epochs = max_steps, num_epochs
        state.logging_steps = interval(cfg.log.steps, max_steps, 500)
        state.eval_steps = interval(cfg.eval.steps, max_steps, state.logging_steps)
        state.save_steps = interval(cfg.save.steps, max_steps, 500)
        state.train_batch_size = run.micro_batch_size
        state.is_world_process_zero, state.is_local_process_zero = strategy.is_global_zero, strategy.is_local_zero
        log_training_start(
            self, loader, batches_per_epoch, max_steps, num_epochs, updates_per_epoch, resume_path
        )  # HF's block

        model = run.wrapped
        assert model is not None  # Run.__post_init__ sets it, and nothing sets it back to None
        self.step = TrainStep(
            run,
            strategy,
            run.facts,
            cfg,
            hooks.training_step,
            hooks.current_learning_rate,
            wants_num_items=self.wants_num_items,
        )
        self.meter = FitMeter(run, strategy, cfg, self.memory_tracker)  # samples, tokens, FLOPs and their figures
        self._event("on_train_begin")
        if cfg.eval.on_start and not resume_path:
            with evaluation_out_of_memory(bool(cfg.data.auto_find_batch_size)):
                evaluate_during_training(hooks, run, cfg, self.ignore_keys_for_eval, on_start=True)
        start = time.perf_counter()
        self.losses = RunningLoss(
            NonFiniteGuard(int(cfg.train.max_nonfinite_steps)), bool(cfg.log.nan_inf_filter), state.global_step
        )  # nan/inf losses: warn, then stop
        self.nan_window = cfg.log.nonfinite_window == "nan"  # kiln's; HF's "filtered" logs the filter's stand-in
        self.steps_this_run = 0
        self.meter.begin(start)
        self.grad_norm: torch.Tensor | None = None
        self.epoch_rng = EpochRandomState(loader)
        self.oom = OomRecovery(self)  # auto_find_batch_size: a later out-of-memory shrinks the micro-batch
        self.guarding = self.oom.enabled
        if restored is not None and restored.loop is not None:  # the running loss sums exactly as they were saved
            self.load_state_dict(restored.loop)
        saved_dataset = restored.dataset if restored is not None else None
        model.train()
        optimizer_mode(run.optimizer, "train")  # schedule-free optimizers step only in train mode
        seed = cfg.data_seed if cfg.data_seed is not None else cfg.seed
        if state.global_step >= max_steps:  # resumed from the final checkpoint: nothing left to train
            return self._finish(start)
        for epoch in range(state.epoch_index, num_epochs):
            set_epoch(loader, epoch, seed)
            skip = state.batches_into_epoch if epoch == state.epoch_index else 0
            if skip and cfg.train.ignore_data_skip:
                skip = 0
            if not skip:  # the iterator draws its epoch order from the restored RNG, as the uninterrupted run's did
                self._restore_rng()
            self.epoch_rng.begin_epoch(skip)  # resumed mid-epoch: the epoch start's RNG, for the same order
            iterator = resume_iterator(
                loader, skip, saved_dataset, main=strategy.is_global_zero, progress=not cfg.log.disable_tqdm
            )  # jumps; never re-iterates map-style data
            saved_dataset = None
            state.epoch_index, state.batches_into_epoch = epoch, skip
            self._restore_rng()  # right before the first batch: nothing in between draws
            self._event("on_epoch_begin")
            while not (run.control.should_epoch_stop or run.control.should_training_stop):
                window = self._next_window(iterator, run.accumulation)
                if not window:
                    break
                try:
                    self._train_window(window, model)
                except WindowOutOfMemory:
                    del window, iterator  # frees the batches and the old loader's workers
                    loader, iterator = self.oom.recover(epoch, seed)  # same samples, smaller micro-batches
                    self._show_callbacks(loader)
                    self.step.weighs = self.step.windows_need_weights(run.accumulation)
                    batches_per_epoch = loader_length(loader)
                    continue
                state.batches_into_epoch += len(window)
                state.epoch = epoch + (state.batches_into_epoch / batches_per_epoch if batches_per_epoch else 1.0)
                control = self._event("on_step_end")
                if self.preemption.enabled and self.preemption.requested():  # SIGTERM on some rank: save, stop
                    control.should_save = control.should_training_stop = True
                self._log_save_evaluate()
                if self.preemption.triggered:
                    self._save_and_stop()
                self.checkpoints.step_end()  # save.async: an upload that waited for the background write
                if state.global_step >= max_steps:
                    run.control.should_training_stop = True
            stopped = run.control.should_training_stop
            if batches_per_epoch is None and not stopped and state.batches_into_epoch == 0:
                raise ValueError("The iterable training dataset yielded no batches; check train_dataset.")
            if not stopped or state.batches_into_epoch == (batches_per_epoch or -1):  # the epoch finished
                state.epoch_index, state.batches_into_epoch = epoch + 1, 0
            self._event("on_epoch_end").should_epoch_stop = False
            self._log_save_evaluate()
            if run.control.should_training_stop:
                break
        return self._finish(start)

    def _event(self, name: str, **kw: Any) -> TrainerControl:
        """Call `name` on the callbacks. What they return (a callback may return a new TrainerControl, as in
        HF) is the run's control from then on: the Run is its one owner, and every reader reads it there."""
        run = self.run
        run.control = self.callbacks.call(name, self.config, run.state, run.control, **kw)
        return run.control

    def _restore_rng(self) -> None:
        if self._rng is not None:
            set_rng_state(self._rng)
            self._rng = None

    # -- checkpoint state (per rank) ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The running sums behind logged losses and `train_loss`, so a resumed run logs the same numbers."""
        return {**self.losses.state_dict(self.steps_this_run), "epoch_rng": self.epoch_rng.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses.load_state_dict(state, self.run.state.global_step)
        self.epoch_rng.load_state_dict(state.get("epoch_rng"))

    def _show_callbacks(self, loader: Iterable[Any]) -> None:
        """The set-up objects every callback event receives from here on (HF updates them at the same point)."""
        run = self.run
        self.callbacks.objects.update(
            model=run.model, optimizer=run.optimizer, lr_scheduler=run.scheduler, train_dataloader=loader
        )

    def _train_dataloader(self, resume_path: str | None) -> Iterable[Any]:
        hooks, run = self.hooks, self.run
        if not self.config.data.auto_find_batch_size or self.restarted:
            return hooks.get_train_dataloader()
        saved = saved_batch_size(resume_path) if resume_path else None
        if saved is None:
            return find_batch_size(self)
        # the sizes the checkpoint's data position counts in (oom_recovery may have changed both)
        run.micro_batch_size, run.accumulation = saved
        return hooks.get_train_dataloader()

    # -- one optimizer step -----------------------------------------------------------------
    def _next_window(self, iterator: Iterator[Any], k: int) -> list[Any]:
        window = []
        for _ in range(k):
            if (batch := next(iterator, _END)) is _END:
                break
            window.append(batch)
        return window

    def _train_window(self, window: list[Any], model: Any) -> None:
        """One optimizer step over `window` (see TrainStep) with the callbacks and counters around it."""
        strategy, state = self.strategy, self.run.state
        self._event("on_step_begin")
        loaded, window = window, [strategy.batch_to_device(b) for b in window]
        losses, result = self.step(window, model, self)
        # after the step: a window redone after an out-of-memory error counts once
        self.meter.count(window, state, loaded)
        self.grad_norm = result.grad_norm
        state.global_step += 1
        self.steps_this_run += 1
        self.losses.pending.append(losses)  # only queued (no tensor op): read at log/save/guard steps, in one transfer

    # StepEvents: what happens between the parts of a step (and `guarding`, set with `oom`)
    def guard(self, model: Any) -> AbstractContextManager[Any]:
        return self.oom.guard(model)

    def substep_end(self) -> None:
        self._event("on_substep_end")

    def pre_optimizer_step(self) -> None:
        if self.callbacks.by_event["on_pre_optimizer_step"]:  # events no callback listens to are not called at all
            self._event("on_pre_optimizer_step")

    def optimizer_step(self) -> None:
        if self.callbacks.by_event["on_optimizer_step"]:
            self._event("on_optimizer_step")

    # -- cadence ----------------------------------------------------------------------------
    def _log_save_evaluate(self) -> None:
        hooks, run, losses = self.hooks, self.run, self.losses
        control, state = run.control, run.state
        folded = control.should_log or control.should_save
        if folded:
            self.meter.flush_flos(state)
            losses.fold(state.global_step, self.strategy)
        elif state.global_step >= losses.guard.next_check:  # the nan/inf limit could be reached here: read now
            losses.fold(state.global_step, self.strategy)
        if control.should_log and state.global_step > losses.last_logged:
            steps = state.global_step - losses.last_logged
            loss = mean_over_ranks(losses.tr_loss, self.strategy) / steps
            if not losses.guard.window_finite and self.nan_window:  # all nan/inf: the filter's stand-in reads 0.0
                loss = math.nan
            losses.guard.window_finite = False
            logs: dict[str, float] = {"loss": loss}
            if self.grad_norm is not None:
                logs["grad_norm"] = float(self.grad_norm.item())
            logs["learning_rate"] = self.step.step_lr
            # Throughput goes to the loggers only: log_history keeps HF's keys, so a resumed run's equals an
            # uninterrupted one's.
            figures = self.meter.window_figures(steps, self.precision)
            losses.last_logged = state.global_step
            losses.tr_loss = 0.0
            run.log_to_loggers_only = figures
            hooks.log(logs)
        metrics = None
        if run.control.should_evaluate:  # log() ran on_log, whose callbacks may have returned a new control
            with evaluation_out_of_memory(bool(self.config.data.auto_find_batch_size)):
                metrics = evaluate_during_training(hooks, run, self.config, self.ignore_keys_for_eval)
        if run.control.should_save:  # the loop's sums go with it: a resumed run logs the same averages
            if not folded:  # asked for after the step (on_log, on_evaluate, save_strategy "best")
                self.meter.flush_flos(state)
                losses.fold(state.global_step, self.strategy)
            losses.guard.note_save(f"The checkpoint of step {state.global_step}")
            hooks._save_checkpoint(metrics)
            self._event("on_save")
        run.control._new_step()

    def _save_and_stop(self) -> None:
        """Preempted: make sure this step is saved (save_strategy 'best' may have declined); training then
        ends as HF's JIT checkpoint ends it (should_training_stop: on_train_end runs, fit() returns)."""
        step = self.run.state.global_step
        if self.checkpoints.saved_step != step:
            self.losses.fold(step, self.strategy)
            self.hooks._save_checkpoint()
        self.checkpoints.wait()  # save.async_save: the checkpoint is complete before the job may be reclaimed
        self.checkpoints.preempted_step = step  # `kiln fit` stops after fit() (exit 0)
        self.preemption.stop(step)

    def _finish(self, start: float) -> TrainOutput:
        hooks, cfg = self.hooks, self.config
        state, losses = self.run.state, self.losses
        self.checkpoints.wait()  # save.async_save: the last checkpoint is complete (and its failure raised) first
        runtime = time.perf_counter() - start
        self.meter.flush_flos(state)
        losses.fold(state.global_step, self.strategy)
        steps = max(losses.steps_before_resume + self.steps_this_run, 1)
        train_loss = mean_over_ranks(losses.total_loss, self.strategy) / steps
        if losses.guard.warned and not losses.guard.any_finite and self.nan_window:
            train_loss = math.nan
        losses.guard.note_save("The model this fit leaves (and any save_model after it)")
        world = self.strategy.data_shards
        metrics = {
            "train_runtime": runtime,
            "train_samples_per_second": self.meter.samples * world / max(runtime, 1e-9),
            "train_steps_per_second": self.steps_this_run / max(runtime, 1e-9),
            "total_flos": state.total_flos,
            "train_loss": train_loss,
        }
        if self.meter.tokens:
            metrics["train_tokens_per_second"] = self.meter.tokens * self.strategy.item_shards / max(runtime, 1e-9)
        metrics.update(self.meter.run_throughput(runtime))
        if cfg.eval.load_best_model_at_end:
            hooks._load_best_model()
        self.memory_tracker.stop_and_update("train", metrics)
        hooks.log(dict(metrics))
        self._event("on_train_end")
        return TrainOutput(state.global_step, train_loss, metrics)


_END = object()
