"""One owner of `TrainerControl`: a callback may return a new control object from any event (HF's
`CallbackHandler.call_event` takes the return value as the control from then on), and the flags it
set must be what the next reader sees: the log/save/evaluate cadence, the stop checks, the next event."""

from __future__ import annotations

import os

from kiln import Trainer
from kiln.engine.callbacks.base import Callback
from kiln.engine.callbacks.state import TrainerControl
from tests.helpers import TinyRegressor, base_config, regression_data


class FreshControl(Callback):
    """Returns a brand-new TrainerControl from `event` at global step `step`, with `flags` set on it."""

    def __init__(self, event: str, step: int, **flags: bool) -> None:
        self.event, self.step, self.flags = event, step, flags

    def _answer(self, event, state):
        if event != self.event or state.global_step != self.step:
            return None
        fresh = TrainerControl()
        for name, value in self.flags.items():
            setattr(fresh, name, value)
        return fresh

    def on_step_begin(self, config, state, control, **kw):
        return self._answer("on_step_begin", state)

    def on_substep_end(self, config, state, control, **kw):
        return self._answer("on_substep_end", state)

    def on_step_end(self, config, state, control, **kw):
        return self._answer("on_step_end", state)

    def on_epoch_end(self, config, state, control, **kw):
        return self._answer("on_epoch_end", state)


def _fit(tmp_path, callback, **cfg):
    settings = {"max_steps": 6, "learning_rate": 1e-2, "per_device_train_batch_size": 4, **cfg}
    trainer = Trainer(
        TinyRegressor(), base_config(tmp_path, **settings), train_dataset=regression_data(16), callbacks=[callback]
    )
    trainer.fit()
    return trainer


def _checkpoints(trainer):
    out = trainer.config.output_dir
    return (
        sorted(int(n.split("-")[1]) for n in os.listdir(out) if n.startswith("checkpoint-"))
        if os.path.isdir(out)
        else []
    )


def test_a_new_control_from_on_step_end_saves_at_that_step(tmp_path):
    trainer = _fit(tmp_path, FreshControl("on_step_end", 2, should_save=True))
    assert _checkpoints(trainer) == [2]


def test_a_new_control_from_on_step_end_stops_training(tmp_path):
    trainer = _fit(tmp_path, FreshControl("on_step_end", 3, should_training_stop=True))
    assert trainer.state.global_step == 3


def test_a_new_control_from_on_step_end_logs_at_that_step(tmp_path):
    trainer = _fit(tmp_path, FreshControl("on_step_end", 2, should_log=True))
    logged = [entry["step"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged == [2]


def test_a_new_control_from_on_step_begin_reaches_on_step_end_and_the_cadence(tmp_path):
    # returned before step 3 is taken (global_step 2): it stops training after that step, as HF's loop would
    callback = FreshControl("on_step_begin", 2, should_training_stop=True, should_save=True)
    trainer = _fit(tmp_path, callback)
    assert trainer.state.global_step == 3 and _checkpoints(trainer) == [3]


def test_a_new_control_from_on_substep_end_reaches_the_step(tmp_path):
    callback = FreshControl("on_substep_end", 1, should_save=True)  # the first micro-batch of step 2
    trainer = _fit(tmp_path, callback, gradient_accumulation_steps=2, max_steps=3)
    assert _checkpoints(trainer) == [2]


def test_a_new_control_from_on_epoch_end_saves_and_stops(tmp_path):
    # 16 samples / 4 per step: an epoch is 4 steps; the first epoch's end returns a control that saves and stops
    callback = FreshControl("on_epoch_end", 4, should_save=True, should_training_stop=True)
    trainer = _fit(tmp_path, callback, max_steps=-1, num_train_epochs=3)
    assert trainer.state.global_step == 4 and _checkpoints(trainer) == [4]


def test_trainer_control_is_the_one_the_last_event_returned(tmp_path):
    returned = []

    class Last(Callback):
        def on_train_end(self, config, state, control, **kw):
            returned.append(TrainerControl())
            return returned[-1]

    trainer = Trainer(
        TinyRegressor(), base_config(tmp_path, max_steps=2), train_dataset=regression_data(16), callbacks=[Last()]
    )
    trainer.fit()
    assert trainer.control is returned[0]


class SaveOnEvaluate(Callback):
    """Returns a new control asking for a save from `on_evaluate` (the flow callback did not ask for one)."""

    def on_evaluate(self, config, state, control, **kw):
        fresh = TrainerControl()
        fresh.should_save = True
        return fresh


def test_a_save_asked_for_after_the_step_resumes_to_the_same_training_loss(tmp_path):
    # the save is decided only by on_evaluate's new control (no logging, no save cadence): the checkpoint must
    # still hold the loss sums up to its step, or the resumed run reports another train_loss
    settings = {
        "max_steps": 6,
        "learning_rate": 1e-2,
        "per_device_train_batch_size": 4,
        "eval_strategy": "steps",
        "eval_steps": 3,
    }
    data = regression_data(16)

    def trainer(out, **kw):
        return Trainer(
            None,
            base_config(out, **settings),
            model_init=TinyRegressor,
            train_dataset=data,
            eval_dataset=data[:8],
            callbacks=[SaveOnEvaluate()],
            **kw,
        )

    whole = trainer(tmp_path / "a").fit()
    first = trainer(tmp_path / "b")
    first.fit()
    assert _checkpoints(first) == [3, 6]
    resumed = trainer(tmp_path / "b").fit(resume_from_checkpoint=str(tmp_path / "b" / "out" / "checkpoint-3"))
    assert resumed.training_loss == whole.training_loss
