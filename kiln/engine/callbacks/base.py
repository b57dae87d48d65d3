"""Callbacks with Hugging Face's events, the dispatcher, and the flow callback that turns the
logging/eval/save intervals into control flags.

Event order for one optimizer step: on_step_begin, (on_substep_end per accumulated micro-batch),
on_pre_optimizer_step, on_optimizer_step, on_step_end, then on_log / on_evaluate / on_save as the
control flags ask. Callbacks observe and set flags; they never change the loop's numerics.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kiln.utils.hf_logging import hf_logger

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.engine.callbacks.state import TrainerControl, TrainerState

logger = logging.getLogger(__name__)

EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_substep_end",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_evaluate",
    "on_predict",
    "on_prediction_step",
    "on_save",
    "on_log",
    "on_exception",  # kiln's (Lightning's): the fit is ending with `exception=`; it is re-raised afterwards
)


class Callback:
    """Override any event; each receives `(config, state, control, **kwargs)` and may return a
    TrainerControl (or None). kwargs carry `model`, `optimizer`, `lr_scheduler`, `train_dataloader`,
    `logs` / `metrics` where relevant.

    A callback with state has it saved in every checkpoint and restored on resume, in either form:
    HF's `ExportableState` (`state()` returning `{"args": {...}, "attributes": {...}}`; on resume the
    attributes are set back, and with `restore_callback_states_from_checkpoint` the callback is rebuilt
    from the saved args first, as HF does) or kiln's `state_dict()` / `load_state_dict()`.

    With `save.async_save`, a checkpoint is written after `on_save` unless a callback that overrides
    `on_save` may read its folder: set `reads_checkpoint_on_save = False` on one that does not, so the
    save stays in the background."""

    reads_checkpoint_on_save: bool = True

    def on_init_end(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any: ...
    def on_train_begin(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any: ...
    def on_train_end(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any: ...
    def on_epoch_begin(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any: ...
    def on_epoch_end(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any: ...
    def on_step_begin(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any: ...
    def on_substep_end(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any: ...
    def on_pre_optimizer_step(
        self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any: ...
    def on_optimizer_step(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any: ...
    def on_step_end(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any: ...
    def on_evaluate(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any: ...
    def on_predict(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any: ...
    def on_prediction_step(
        self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any: ...
    def on_save(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any: ...
    def on_log(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any: ...
    def on_exception(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any: ...


CallbackLike = Callback | type

# The flags HF's CallbackHandler clears before it calls an event, so a callback sees (and a checkpoint's
# saved TrainerControl records) the same flags as under HF: e.g. should_log is False again once on_log ran.
_CLEARS = {
    "on_train_begin": ("should_training_stop",),
    "on_epoch_begin": ("should_epoch_stop",),
    "on_step_begin": ("should_log", "should_evaluate", "should_save"),
    "on_evaluate": ("should_evaluate",),
    "on_save": ("should_save",),
    "on_log": ("should_log",),
}


#: the objects every event receives as keyword arguments, as HF's CallbackHandler passes them
HF_OBJECTS = ("model", "processing_class", "optimizer", "lr_scheduler", "train_dataloader", "eval_dataloader")


class CallbackHandler:
    """Calls each event on every callback that overrides it, in registration order."""

    def __init__(self, callbacks: Iterable[CallbackLike] = (), **objects: Any) -> None:
        self.callbacks: list[Callback] = []
        # HF passes these six to every event, None until the Trainer has them (call_event in trainer_callback.py)
        self.objects: dict[str, Any] = {**dict.fromkeys(HF_OBJECTS), **objects}
        self.by_event: dict[str, list[Any]] = {}  # event -> the handlers that override it (read-only; see _index)
        for cb in callbacks:
            self.add(cb)

    def add(self, callback: CallbackLike) -> None:
        cb = callback() if isinstance(callback, type) else callback
        if any(type(c) is type(cb) for c in self.callbacks):  # usually a mistake (events run twice): HF's warning
            names = "\n".join(type(c).__name__ for c in self.callbacks)
            hf_logger("transformers.trainer_callback", logger).warning(
                f"You are adding a {type(cb)} to the callbacks of this Trainer, but there is already one; its events will "
                f"run twice (remove one, or pass a single instance). The current list of callbacks is:\n{names}"
            )
        self.callbacks.append(cb)
        self._index()

    def pop(self, callback: CallbackLike) -> Callback | None:
        for cb in self.callbacks:
            if (isinstance(callback, type) and isinstance(cb, callback)) or cb is callback:
                self.callbacks.remove(cb)
                self._index()
                return cb
        return None

    def _index(self) -> None:
        # Only callbacks that override an event are called for it: keeps the per-step cost small.
        self.by_event = {
            event: [
                getattr(cb, event)
                for cb in self.callbacks
                if getattr(type(cb), event, None) not in (None, getattr(Callback, event))  # HF's have no on_exception
            ]
            for event in EVENTS
        }

    def reads_checkpoint_on_save(self) -> bool:
        """Whether a callback's on_save may read the checkpoint folder (an asynchronous save then completes
        before on_save runs, as HF's callbacks expect)."""
        return any(getattr(handler.__self__, "reads_checkpoint_on_save", True) for handler in self.by_event["on_save"])

    def call(
        self, event: str, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        for flag in _CLEARS.get(event, ()):
            setattr(control, flag, False)
        handlers = self.by_event[event]
        if not handlers:
            return control
        kw = {**self.objects, **kw} if kw else self.objects  # the per-step events pass no kwargs: no dict built
        for handler in handlers:
            result = handler(config, state, control, **kw)
            if result is not None:
                control = result
        return control

    # -- callback state in checkpoints ------------------------------------------------------
    def state_dict(self, control: TrainerControl | None = None) -> dict[str, Any]:
        """`trainer_state.json`'s `stateful_callbacks`, in HF's layout: class name -> state, or a list of
        states when several callbacks share a class, and last (as HF's `_save_checkpoint` does) the
        run's `TrainerControl` flags as they stand when the checkpoint is written."""
        states: dict[str, Any] = {}
        for cb in self.callbacks:
            state = _export(cb)
            if state is None:
                continue
            name = type(cb).__name__
            if name in states:
                states[name] = [*(states[name] if isinstance(states[name], list) else [states[name]]), state]
            else:
                states[name] = state
        if control is not None:
            states["TrainerControl"] = control.state()
        return states

    def load_state_dict(self, states: dict[str, Any], restore_args: bool = False) -> list[str]:
        """Give each callback its saved state back; returns the saved class names no callback has.

        `restore_args` (HF's `restore_callback_states_from_checkpoint`) rebuilds an ExportableState
        callback from its saved `args` (e.g. EarlyStoppingCallback's patience) before setting the
        attributes; without it the attributes (counters) come back and this run's arguments stay."""
        missing = []
        for name, data in (states or {}).items():
            if name == "TrainerControl":  # HF's own flags: a new run's first events clear them all anyway
                continue
            matching = [i for i, cb in enumerate(self.callbacks) if type(cb).__name__ == name]
            if not matching:
                missing.append(name)
                continue
            for index, entry in zip(matching, data if isinstance(data, list) else [data]):
                self.callbacks[index] = _restore(self.callbacks[index], entry, restore_args)
        self._index()
        return missing


def _export(cb: Any) -> Any | None:
    if callable(getattr(cb, "state", None)):  # HF's ExportableState
        return cb.state()
    if callable(getattr(cb, "state_dict", None)):
        return cb.state_dict()
    return None


def _is_exported(entry: Any) -> bool:
    return isinstance(entry, dict) and "attributes" in entry and set(entry) <= {"args", "attributes"}


def _restore(cb: Any, entry: Any, restore_args: bool) -> Any:
    """The callback with `entry` restored (a new instance when rebuilt from the saved args)."""
    if _is_exported(entry):
        if restore_args and isinstance(entry.get("args"), dict):
            cb = type(cb)(**entry["args"])
        for key, value in entry["attributes"].items():
            setattr(cb, key, value)
    elif callable(getattr(cb, "load_state_dict", None)):
        cb.load_state_dict(entry)
    return cb


def interval(value: float | None, max_steps: int, default: int) -> int:
    """HF's `*_steps`: an int, or a ratio in (0, 1) of the total steps (rounded up)."""
    import math

    if value is None:
        return default
    if 0 < value < 1:
        return max(1, math.ceil(max_steps * value))
    return int(value)


class DefaultFlowCallback(Callback):
    """Turns `log/eval/save.strategy` and their `steps` into control flags (HF semantics).

    The settings are copied to plain attributes at train begin: this runs every step."""

    def on_train_begin(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        self.log_first = bool(config.log.first_step)
        self.log_strategy, self.eval_strategy = config.log.strategy, config.eval.strategy
        self.save_strategy, self.eval_delay = config.save.strategy, float(config.eval.delay)

    def on_step_end(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        step = state.global_step
        if step == 1 and self.log_first:
            control.should_log = True
        if self.log_strategy == "steps" and step % state.logging_steps == 0:
            control.should_log = True
        if self.eval_strategy == "steps" and step % state.eval_steps == 0 and self.eval_delay <= step:
            control.should_evaluate = True
        if self.save_strategy == "steps" and step % state.save_steps == 0:
            control.should_save = True
        if step >= state.max_steps:
            control.should_training_stop = True
            # HF also evaluates the final step when it is off the eval_steps grid (never twice)
            if self.eval_strategy == "steps" and step % state.eval_steps != 0 and self.eval_delay <= step:
                control.should_evaluate = True
            # and saves it with save_strategy steps; with epoch, on_epoch_end saves it (once)
            if self.save_strategy == "steps":
                control.should_save = True
        return control

    def on_epoch_end(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        if self.log_strategy == "epoch":
            control.should_log = True
        if self.eval_strategy == "epoch" and self.eval_delay <= state.epoch:
            control.should_evaluate = True
        if self.save_strategy == "epoch":
            control.should_save = True
        return control
