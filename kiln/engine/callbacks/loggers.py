"""Connects the Logger objects to the loop: a callback the Trainer builds on global rank 0 only.

It turns the loop's events into the Logger life cycle: on_train_begin tells every logger the step
training (re)starts from (a resume truncates the local histories), then logs the resolved config once
per run; on_log sends the numeric entries of each log dict with `state.global_step`; on_save and
on_train_end upload checkpoints when `log.log_artifacts` asks; on_train_end finalizes. A process that
exits without on_train_end (an exception in training) marks its runs failed.

Every logger call runs on the background writer (kiln/loggers/writer.py), in order: the training
thread only builds the record. It waits for the writer before a checkpoint is saved (so a resumed
run finds every record up to its checkpoint on disk), before uploading artifacts, when training ends
and when an evaluate() outside training returns."""

from __future__ import annotations

import atexit
import collections
import functools
import os
import weakref
from typing import TYPE_CHECKING, Any

from kiln.engine.callbacks.base import Callback
from kiln.loggers.base import Logger, flatten
from kiln.loggers.build import artifact_mode, scalar_metrics
from kiln.loggers.writer import shared_writer

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.engine.callbacks.state import TrainerControl, TrainerState


def _checkpoint_dir(config: DictConfig, state: TrainerState, at_end: bool) -> str | None:
    if at_end and state.best_model_checkpoint and os.path.isdir(state.best_model_checkpoint):
        return state.best_model_checkpoint
    path = os.path.join(str(config.output_dir), f"checkpoint-{state.global_step}")
    return path if os.path.isdir(path) else None


class LoggerCallback(Callback):
    def __init__(self, config: DictConfig, loggers: list[Logger]) -> None:
        self.config = config
        self.loggers = loggers
        self.artifacts = {id(lg): artifact_mode(config, lg.name) for lg in loggers}
        self._params_run: Any = _NOT_LOGGED  # the trial whose run has the config logged
        self._trial: str | None = None
        self._training = False
        self._records: collections.deque[tuple[dict[str, float], int]] = collections.deque()  # not yet written
        self._exit_hook = functools.partial(_finalize_at_exit, weakref.ref(self))
        self.writer = shared_writer()
        self._register_exit_hook()

    def _register_exit_hook(self) -> None:
        """(Re-)register the exit hook, so it runs before the hooks trackers register when their runs
        start (atexit runs the newest first): a run must be finished while its tracker still works."""
        atexit.unregister(self._exit_hook)
        atexit.register(self._exit_hook)

    def on_train_begin(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if not self.loggers:  # nothing to write: no writer thread, no SIGTERM handler
            return
        trial = state.trial_name if (state.is_hyper_param_search or state.trial_name) else None
        params = None
        if self._params_run != trial:
            from kiln.config.redact import config_for_saving

            params = flatten(config_for_saving(config))  # values from ${oc.env:VAR} stay out of trackers
            self._params_run = trial
        new_trial = trial != self._trial
        self._trial = trial
        for logger in self.loggers:
            logger.capture()
        self.writer.submit(self._begin, trial if new_trial else _SAME, state.trial_params, state.global_step, params)
        self._training = True

    def _begin(self, trial: Any, trial_params: Any, step: int, params: dict[str, Any] | None) -> None:
        if trial is not _SAME:
            for logger in self.loggers:
                logger.set_trial(trial, trial_params)
        for logger in self.loggers:
            logger.resume(step)
        if params is not None:
            for logger in self.loggers:
                logger.log_hyperparams(params)
        self._register_exit_hook()

    def on_log(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if not self.loggers:
            return
        metrics = scalar_metrics(kw.get("logs") or {})
        if metrics:
            self._records.append((metrics, state.global_step))
            backlog = len(self._records)
            if backlog == 1:  # the first of a batch: one task writes what piled up by the writer's tick
                self.writer.submit(self._write)
            elif backlog >= self.writer.maxsize:  # loggers slower than the log rate: wait, do not pile up
                self.writer.flush()
        if control.should_save:  # a checkpoint follows: every record up to its step must be on disk first
            self.writer.flush()

    def _write(self) -> None:
        """Write the queued records, then flush each logger once (on the writer thread). Records queued
        while this runs are written by it too: it stops only when the queue is empty."""
        records, error = self._records, None
        while records:
            metrics, step = records.popleft()
            for logger in self.loggers:
                try:
                    logger.log_metrics(metrics, step)
                except Exception as err:  # the other loggers and records still go out; the first error is raised
                    error = error or err
        for logger in self.loggers:
            logger.flush()
        # here, on the writer thread: a tracker opens its run (and registers its own exit hook) on first use
        self._register_exit_hook()
        if error is not None:
            raise error

    def on_evaluate(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self.loggers and not self._training:  # evaluate() on its own: its record is on disk when it returns
            self.writer.flush()

    @property
    def reads_checkpoint_on_save(self) -> bool:  # type: ignore[override]
        """Only an upload of each checkpoint (log.log_artifacts) reads its folder on save."""
        return "checkpoint" in self.artifacts.values()

    def on_save(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._upload(config, state, "checkpoint")

    def on_train_end(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._upload(config, state, "end")
        self.finalize("success")

    def _upload(self, config: DictConfig, state: TrainerState, when: str) -> None:
        targets = [lg for lg in self.loggers if self.artifacts[id(lg)] == when]
        path = _checkpoint_dir(config, state, at_end=when == "end") if targets else None
        if targets and path:
            # on this thread, after the queued records: a rotated-out checkpoint must not vanish mid-upload
            self.writer.flush()
            for logger in targets:
                logger.log_artifact(path)

    def log_artifact(self, path: str) -> None:
        """Upload a file or folder (e.g. what save_model wrote) to every tracker that stores artifacts."""
        self.writer.flush()
        for logger in self.loggers:
            logger.log_artifact(path)

    def finalize(self, status: str) -> None:
        """Close every run, after every queued record; "success", "failed" or "interrupted". Safe to call
        more than once."""
        self._training = False
        if self.loggers:
            self.writer.submit(self._finalize, status)
            self.writer.flush()

    def _finalize(self, status: str) -> None:
        for logger in self.loggers:
            logger.finalize(status)


_NOT_LOGGED = object()
_SAME = object()  # on_train_begin: the trial has not changed


def _finalize_at_exit(ref: weakref.ref[LoggerCallback]) -> None:
    callback = ref()
    if callback is not None:
        callback.finalize("failed" if callback._training else "success")
