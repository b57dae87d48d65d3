"""The fit loop: epochs, accumulation windows, optimizer steps and the log/eval/save cadence.

One optimizer step, as the loop runs it (every hardware difference is a strategy/precision call):

    window = next k micro-batches               (k = gradient_accumulation_steps, fewer at epoch end)
    N = items in the whole window               (summed over the strategy's data shards)
    for each micro-batch:  with strategy.micro_batch_context(boundary=last):
                               trainer.training_step -> loss * weight -> strategy.backward(boundary)
                           strategy.on_micro_batch_end()
    strategy.optimizer_step(max_grad_norm) -> StepResult(stepped, grad_norm)   # unscale, clip, step, skip
    scheduler.step (if stepped) -> strategy.zero_grad -> strategy.on_step_end

Nothing here reads a device value back to the host between logging steps: the step losses and the
grad norm stay tensors until a log or save step reads them, all the losses in one transfer; from there
the running sums are host floats (float64), as HF's `_total_loss_scalar` is.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

import torch

from kiln.optim.optimizers import optimizer_mode
from kiln.engine.callbacks.base import interval
from kiln.engine.data.epoch_rng import EpochRandomState
from kiln.engine.data.loaders import loader_length, set_epoch
from kiln.engine.loop.loss_reads import NonFiniteGuard, loss_values
from kiln.engine.loop.loss_weights import MicroBatch
from kiln.engine.loop.oom_recovery import OomRecovery, WindowOutOfMemory
from kiln.engine.loop.plan import plan_steps
from kiln.engine.loop.preemption import Preemption
from kiln.utils.tensors import batch_size_of

if TYPE_CHECKING:
    from kiln.engine.protocols import TrainerLike


class TrainOutput(tuple):
    """(global_step, training_loss, metrics), with attribute access as in HF."""

    def __new__(cls, global_step: int, training_loss: float, metrics: dict[str, float]) -> "TrainOutput":
        return super().__new__(cls, (global_step, training_loss, metrics))

    global_step = property(lambda self: self[0])
    training_loss = property(lambda self: self[1])
    metrics = property(lambda self: self[2])

    def __repr__(self) -> str:
        return f"TrainOutput(global_step={self[0]}, training_loss={self[1]:.6g}, metrics={self[2]})"


class FitLoop:
    def __init__(self, trainer: "TrainerLike") -> None:
        self.trainer = trainer

    def run(self, resume_path: Optional[str]) -> TrainOutput:
        with Preemption(self.trainer.strategy, bool(self.trainer.config.save.on_preemption)) as self.preemption:
            return self._run(resume_path)

    def _run(self, resume_path: Optional[str]) -> TrainOutput:
        t = self.trainer
        cfg, strategy = t.config, t.strategy
        loader = self._train_dataloader(resume_path)
        t.checkpoints.attach(self, loader)  # the loop's sums and the data position go into checkpoints
        batches_per_epoch = loader_length(loader)
        max_steps, num_epochs, per_epoch = plan_steps(cfg, batches_per_epoch)
        if max_steps <= 0:  # HF trains 0 steps and reports success; a config for evaluate/predict may say 0
            raise ValueError("train.num_train_epochs is 0 and train.max_steps is unset, so fit() would train nothing: set "
                             "num_train_epochs > 0 or max_steps > 0 (to score a model without training, use evaluate).")
        t.setup_training(max_steps)
        state = t.state
        if resume_path:
            t.checkpoints.load(resume_path)
            state = t.state
        state.max_steps, state.num_train_epochs = max_steps, num_epochs
        state.logging_steps = interval(cfg.log.steps, max_steps, 500)
        state.eval_steps = interval(cfg.eval.steps, max_steps, state.logging_steps)
        state.save_steps = interval(cfg.save.steps, max_steps, 500)
        state.train_batch_size = cfg.data.per_device_train_batch_size
        state.is_world_process_zero, state.is_local_process_zero = strategy.is_global_zero, strategy.is_local_zero

        model, k = t.model_wrapped, cfg.train.gradient_accumulation_steps
        # Plain copies of the settings the per-step path reads (an OmegaConf lookup costs microseconds).
        self.max_grad_norm = float(cfg.train.max_grad_norm or 0.0)
        self.nan_inf_filter = bool(cfg.log.nan_inf_filter)
        self.guard = NonFiniteGuard(int(cfg.train.max_nonfinite_steps))  # nan/inf losses: warn, then stop
        self.count_tokens_seen = bool(cfg.train.include_num_input_tokens_seen)
        self.model_flops = getattr(t.model, "floating_point_ops", None)
        self.flops_per_token = 6.0 * sum(p.numel() for p in t.model.parameters())
        self.local_flos = 0.0
        # The strategy's per-step hooks that are the base no-ops are not called at all (resolved once here).
        self.micro_batch_context = strategy.micro_batch_context if strategy.overrides("micro_batch_context") else None
        self.on_micro_batch_end = strategy.on_micro_batch_end if strategy.overrides("on_micro_batch_end") else None
        self.on_strategy_step_end = strategy.on_step_end if strategy.overrides("on_step_end") else None
        self.weighs = t.windows_need_weights(k)  # False: every window's loss weights are None
        control = t.callback_handler.call("on_train_begin", cfg, state, t.control)
        if cfg.eval.on_start and not resume_path:
            t.evaluate_during_training(on_start=True)
        start = time.perf_counter()
        self.tr_loss = 0.0  # the loss sum of the steps since the last log (HF's tr_loss), folded in
        self.total_loss = 0.0  # the loss sum of every step, for train_loss (HF's _total_loss_scalar)
        self.steps_this_run, self.samples, self.tokens = 0, 0, 0
        self.last_logged, self.window_start = state.global_step, start
        self.samples_at_log, self.tokens_at_log = 0, 0
        self.steps_before_resume = 0
        self.pending: list[list[torch.Tensor]] = []  # per step, its micro-batch losses not yet folded into the sums
        self.epoch_rng = EpochRandomState(loader)
        self.oom = OomRecovery(self)  # auto_find_batch_size: a later out-of-memory shrinks the micro-batch
        t.checkpoints.restore_loop(self)  # resumed: the running loss sums exactly as they were saved
        model.train()
        optimizer_mode(t.optimizer, "train")  # schedule-free optimizers step only in train mode
        seed = cfg.data_seed if cfg.data_seed is not None else cfg.seed
        if state.global_step >= max_steps:  # resumed from the final checkpoint: nothing left to train
            return self._finish(start)
        for epoch in range(state.epoch_index, num_epochs):
            set_epoch(loader, epoch, seed)
            skip = state.batches_into_epoch if epoch == state.epoch_index else 0
            if skip and cfg.train.ignore_data_skip:
                skip = 0
            if not skip:  # the iterator draws its epoch order from the restored RNG, as the uninterrupted run's did
                t.checkpoints.restore_rng()
            self.epoch_rng.begin_epoch(skip)  # resumed mid-epoch: the epoch start's RNG, for the same order
            iterator = t.checkpoints.resume_iterator(loader, skip)  # jumps; never re-iterates map-style data
            state.epoch_index, state.batches_into_epoch = epoch, skip
            t.checkpoints.restore_rng()  # right before the first batch: nothing in between draws
            control = t.callback_handler.call("on_epoch_begin", cfg, state, control)
            while not (control.should_epoch_stop or control.should_training_stop):
                window = self._next_window(iterator, k)
                if not window:
                    break
                try:
                    self._optimizer_step(window, model)
                except WindowOutOfMemory:
                    del window, iterator  # frees the batches and the old loader's workers
                    loader, iterator, k = self.oom.recover(epoch, seed)  # same samples, smaller micro-batches
                    self.weighs = t.windows_need_weights(k)
                    batches_per_epoch = loader_length(loader)
                    continue
                state.batches_into_epoch += len(window)
                state.epoch = epoch + (state.batches_into_epoch / batches_per_epoch if batches_per_epoch else 1.0)
                control = t.callback_handler.call("on_step_end", cfg, state, control)
                if self.preemption.enabled and self.preemption.requested():  # SIGTERM on some rank: save, exit 0
                    control.should_save = control.should_training_stop = True
                self._log_save_evaluate()
                if self.preemption.triggered:
                    self._save_and_exit()
                if state.global_step >= max_steps:
                    control.should_training_stop = True
            if batches_per_epoch is None and not control.should_training_stop and state.batches_into_epoch == 0:
                raise ValueError("The iterable training dataset yielded no batches; check train_dataset.")
            epoch_finished = not control.should_training_stop or state.batches_into_epoch == (batches_per_epoch or -1)
            if epoch_finished:
                state.epoch_index, state.batches_into_epoch = epoch + 1, 0
            control = t.callback_handler.call("on_epoch_end", cfg, state, control)
            control.should_epoch_stop = False
            self._log_save_evaluate()
            if control.should_training_stop:
                break
        return self._finish(start)

    # -- checkpoint state (per rank) ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The running sums behind logged losses and `train_loss`, so a resumed run logs the same numbers."""
        # float64 tensors (checkpoints before host sums held a float32 tr_loss; both load)
        return {"tr_loss": torch.tensor(self.tr_loss, dtype=torch.float64),
                "total_loss": torch.tensor(self.total_loss, dtype=torch.float64),
                "last_logged": self.last_logged, "steps": self.steps_before_resume + self.steps_this_run,
                "epoch_rng": self.epoch_rng.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tr_loss, self.total_loss = float(state["tr_loss"]), float(state["total_loss"])
        self.last_logged, self.steps_before_resume = int(state["last_logged"]), int(state["steps"])
        self.epoch_rng.load_state_dict(state.get("epoch_rng"))
        self.guard.resumed()

    def _train_dataloader(self, resume_path: Optional[str]) -> Iterable[Any]:
        t = self.trainer
        if not t.config.data.auto_find_batch_size:
            return t.get_train_dataloader()
        from kiln.engine.loop.batch_size import find_batch_size, saved_batch_size

        saved = saved_batch_size(resume_path) if resume_path else None
        if saved is None:
            return find_batch_size(t)
        # the sizes the checkpoint's data position counts in (oom_recovery may have changed both)
        t.config.data.per_device_train_batch_size, t.config.train.gradient_accumulation_steps = saved
        return t.get_train_dataloader()

    # -- one optimizer step -----------------------------------------------------------------
    def _next_window(self, iterator: Iterator[Any], k: int) -> list[Any]:
        window = []
        for _ in range(k):
            if (batch := next(iterator, _END)) is _END:
                break
            window.append(batch)
        return window

    def _optimizer_step(self, window: list[Any], model: Any) -> None:
        t = self.trainer
        cfg, strategy, state, opt = t.config, t.strategy, t.state, t.optimizer
        callbacks = t.callback_handler
        control = callbacks.call("on_step_begin", cfg, state, t.control)
        window = list(map(strategy.batch_to_device, window))
        weights = t.loss_weights(window) if self.weighs else None
        num_items = weights.total if weights is not None and t.wants_num_items else None
        if self.oom.enabled:
            with self.oom.guard(model):  # auto_find_batch_size: out of memory here redoes the step smaller
                losses, control = self._micro_batches(window, model, weights, num_items, control)
        else:
            losses, control = self._micro_batches(window, model, weights, num_items, control)
        if self.count_tokens_seen:  # a host read per step only when several shards must be summed (as HF)
            tokens = self.tokens_in(window)
            if strategy.data_shards > 1:
                tokens = int(strategy.reduce(torch.tensor(tokens, device=strategy.root_device), "sum").item())
            state.num_input_tokens_seen += tokens
        listeners = callbacks.by_event  # events no callback listens to are not called at all
        if listeners["on_pre_optimizer_step"]:
            control = callbacks.call("on_pre_optimizer_step", cfg, state, control)
        result = strategy.optimizer_step(model, opt, self.max_grad_norm)
        self.grad_norm: Optional[torch.Tensor] = result.grad_norm
        if listeners["on_optimizer_step"]:
            control = callbacks.call("on_optimizer_step", cfg, state, control)
        self.step_lr = t.current_learning_rate()  # the rate this step used: logged as learning_rate (HF), not the next one's
        if result.stepped and t.lr_scheduler is not None and not t.scheduler_needs_metrics:
            t.lr_scheduler.step()
        strategy.zero_grad(model, opt)
        if self.on_strategy_step_end is not None:
            self.on_strategy_step_end()
        state.global_step += 1
        self.steps_this_run += 1
        self.pending.append(losses)  # only queued (no tensor op): read at log/save steps, in one transfer

    def _micro_batches(self, window: list[Any], model: Any, weights: Any, num_items: Any,
                       control: Any) -> tuple[list[torch.Tensor], Any]:
        """Forward and backward of each micro-batch of the window: their detached losses, and the
        control as the on_substep_end callbacks left it."""
        t = self.trainer
        losses = []
        last = len(window) - 1
        for i, batch in enumerate(window):
            self.samples += batch_size_of(batch)
            ids = batch.get("input_ids") if isinstance(batch, dict) else None
            if isinstance(ids, torch.Tensor):
                self.tokens += ids.numel()
                # total_flos: the model's own count (Transformers), else HF's 6 x tokens x parameters
                self.local_flos += float(self.model_flops(batch)) if self.model_flops else self.flops_per_token * ids.numel()
            t.current_micro_batch = micro = _LONE if last == 0 and weights is None else MicroBatch(i, i == last, weights)
            if self.micro_batch_context is None:
                losses.append(t.training_step(model, batch, num_items_in_batch=num_items))
            else:
                with self.micro_batch_context(model, boundary=micro.boundary):
                    losses.append(t.training_step(model, batch, num_items_in_batch=num_items))
            if self.on_micro_batch_end is not None:
                self.on_micro_batch_end()
            if i < last:
                control = t.callback_handler.call("on_substep_end", t.config, t.state, control)
        t.current_micro_batch = None
        return losses, control

    def _fold(self) -> None:
        """Add the queued micro-batch losses to tr_loss and total_loss (before logs, saves and the end).

        The losses are read here, all at once (see loss_values): a log step reads the loss anyway, and
        summing a few floats on the host costs less than the tensor ops that would keep the sums on
        the device. With `nan_inf_filter`, a nan/inf micro-batch loss counts as the logging window's mean so far, per micro-batch as in HF (the finite micro-batches of the same
        window still count); train_loss uses the same filtered values."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        values = loss_values([loss for micro_losses in pending for loss in micro_losses])
        total = sum(values)  # finite exactly when every loss is (float32 losses cannot overflow a float64 sum)
        if math.isfinite(total):
            self.guard.all_finite()
        else:
            first, i = self.trainer.state.global_step - len(pending) + 1, 0
            for j, micro_losses in enumerate(pending):
                self.guard.step(first + j, values[i:i + len(micro_losses)])
                i += len(micro_losses)
        self.guard.check(self.trainer.strategy)  # too many nan/inf steps: stop here, before a log or save uses them
        if not self.nan_inf_filter or math.isfinite(total):
            self.tr_loss += total
            self.total_loss += total
            return
        values.reverse()
        first_step = self.trainer.state.global_step - len(pending) + 1
        for j, micro_losses in enumerate(pending):
            steps_before = first_step + j - 1 - self.last_logged  # completed steps in this logging window
            for _ in micro_losses:
                value = values.pop()
                if not math.isfinite(value):
                    value = self.tr_loss / (1 + steps_before)
                self.tr_loss += value
                self.total_loss += value

    def _mean_over_ranks(self, value: float) -> float:
        """`value` averaged over the processes (one collective; none on a single process)."""
        strategy = self.trainer.strategy
        if strategy.world_size == 1:
            return value
        return float(strategy.reduce(torch.tensor(value, dtype=torch.float64), "mean").item())

    @staticmethod
    def tokens_in(window: list[Any]) -> int:
        return sum(b["input_ids"].numel() for b in window if isinstance(b, dict) and isinstance(b.get("input_ids"), torch.Tensor))

    # -- cadence ----------------------------------------------------------------------------
    def _flush_flos(self) -> None:
        """Add this window's FLOPs, summed over ranks, to state.total_flos (before logs and saves)."""
        t = self.trainer
        if t.strategy.world_size > 1:
            self.local_flos = float(t.strategy.reduce(torch.tensor(self.local_flos, dtype=torch.float64, device=t.strategy.root_device), "sum").item())
        t.state.total_flos += self.local_flos
        self.local_flos = 0.0

    def _log_save_evaluate(self) -> None:
        t = self.trainer
        control, state = t.control, t.state
        if control.should_log or control.should_save:
            self._flush_flos()
            self._fold()
        if control.should_log and state.global_step > self.last_logged:
            steps = state.global_step - self.last_logged
            loss = self._mean_over_ranks(self.tr_loss) / steps
            if not self.guard.window_finite:  # all nan/inf: the filter's stand-in mean would read 0.0
                loss = math.nan
            self.guard.window_finite = False
            logs: dict[str, float] = {"loss": loss}
            if self.grad_norm is not None:
                logs["grad_norm"] = float(self.grad_norm.item())
            logs["learning_rate"] = self.step_lr
            # Throughput goes to the loggers only: log_history keeps HF's keys, so a resumed run's equals an
            # uninterrupted one's.
            run: dict[str, float] = {}
            if t.precision.uses_grad_scaler:
                run["skipped_steps"] = float(t.precision.skipped_steps)  # inf/nan steps the scaler skipped
            now = time.perf_counter()
            elapsed = max(now - self.window_start, 1e-9)
            world = t.strategy.data_shards
            run["samples_per_second"] = (self.samples - self.samples_at_log) * world / elapsed
            run["steps_per_second"] = steps / elapsed
            if self.tokens > self.tokens_at_log:
                run["tokens_per_second"] = (self.tokens - self.tokens_at_log) * world / elapsed
            self.window_start, self.samples_at_log, self.tokens_at_log = now, self.samples, self.tokens
            self.last_logged = state.global_step
            self.tr_loss = 0.0
            t.log_to_loggers_only = run
            t.log(logs)
        metrics = None
        if control.should_evaluate:
            metrics = t.evaluate_during_training()
        if control.should_save:  # the loop's sums go with it: a resumed run logs the same averages
            self.guard.note_save(f"The checkpoint of step {state.global_step}")
            t._save_checkpoint(metrics)
            t.control = t.callback_handler.call("on_save", t.config, state, t.control)
        t.control._new_step()

    def _save_and_exit(self) -> None:
        """Preempted: make sure this step is saved (save_strategy 'best' may have declined), then exit 0."""
        t = self.trainer
        if t.checkpoints.saved_step != t.state.global_step:
            self._fold()
            t._save_checkpoint()
        self.preemption.exit(t.state.global_step)

    def _finish(self, start: float) -> TrainOutput:
        t = self.trainer
        state, cfg = t.state, t.config
        runtime = time.perf_counter() - start
        self._flush_flos()
        self._fold()
        steps = max(self.steps_before_resume + self.steps_this_run, 1)
        train_loss = self._mean_over_ranks(self.total_loss) / steps
        if self.guard.warned and not self.guard.any_finite:
            train_loss = math.nan
        self.guard.note_save("The model this fit leaves (and any save_model after it)")
        world = t.strategy.data_shards
        metrics = {
            "train_runtime": runtime,
            "train_samples_per_second": self.samples * world / max(runtime, 1e-9),
            "train_steps_per_second": self.steps_this_run / max(runtime, 1e-9),
            "total_flos": state.total_flos,
            "train_loss": train_loss,
        }
        if self.tokens:
            metrics["train_tokens_per_second"] = self.tokens * world / max(runtime, 1e-9)
        if cfg.eval.load_best_model_at_end:
            t._load_best_model()
        t.memory_tracker.stop_and_update("train", metrics)
        t.log(dict(metrics))
        t.control = t.callback_handler.call("on_train_end", cfg, state, t.control)
        return TrainOutput(state.global_step, train_loss, metrics)


_END = object()
_LONE = MicroBatch(0, True, None)  # the usual window's one unweighted micro-batch: no new object a step
