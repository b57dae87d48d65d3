"""Callback state in checkpoints, HF's way: `ExportableState` (`state()` with args and attributes)
next to kiln's `state_dict()`; `restore_callback_states_from_checkpoint` rebuilds callbacks from the
saved args (EarlyStoppingCallback's patience and threshold); and the warnings HF users get."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from kiln.engine.callbacks.base import Callback
from kiln.engine.callbacks.early_stopping import EarlyStoppingCallback
from tests.checkpoint.checkpoint_helpers import regression_data, train
from tests.hf_logs import hf_propagation  # noqa: F401 - a fixture


class Steps(Callback):
    """An HF-style stateful callback: ExportableState's `state()`, no state_dict()."""

    def __init__(self, every: int = 1) -> None:
        self.every, self.seen = every, 0

    def on_step_end(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        self.seen += 1

    def state(self) -> dict[str, Any]:
        return {"args": {"every": self.every}, "attributes": {"seen": self.seen}}


def small_eval():
    return regression_data(8, seed=5)


EVAL = {"eval_strategy": "steps", "eval_steps": 2, "metric_for_best_model": "loss"}


def saved_callbacks(ckpt: str) -> dict[str, Any]:
    with open(os.path.join(ckpt, "trainer_state.json"), encoding="utf-8") as fh:
        return json.load(fh)["stateful_callbacks"]


def test_exportable_state_is_saved_and_its_attributes_restored(tmp_path):
    out = str(tmp_path / "run")
    train(out, {"max_steps": 4, "save_steps": 4}, callbacks=[Steps(every=3)])
    assert saved_callbacks(os.path.join(out, "checkpoint-4"))["Steps"] == {
        "args": {"every": 3},
        "attributes": {"seen": 4},
    }
    again = Steps(every=7)
    train(out, {"max_steps": 6, "save_steps": 4}, resume=True, callbacks=[again])
    assert again.seen == 6 and again.every == 7  # counters back; this run's args kept without the flag


def test_two_callbacks_of_one_class_are_saved_as_a_list_and_restored_in_order(tmp_path, caplog, hf_propagation):
    out = str(tmp_path / "run")
    train(out, {"max_steps": 4, "save_steps": 4}, callbacks=[Steps(1), Steps(2)])
    assert f"You are adding a {Steps} to the callbacks" in caplog.text  # logged, as HF's add_callback does
    saved = saved_callbacks(os.path.join(out, "checkpoint-4"))["Steps"]
    assert [s["args"]["every"] for s in saved] == [1, 2]


def test_restore_callback_states_rebuilds_early_stopping_from_the_checkpoint(tmp_path):
    hf = pytest.importorskip("transformers")
    out = str(tmp_path / "run")
    first = train(
        out,
        {"max_steps": 6, "save_steps": 6, **EVAL},
        eval_data=small_eval,
        callbacks=[EarlyStoppingCallback(early_stopping_patience=50, early_stopping_threshold=0.25)],
    )
    ckpt = os.path.join(out, "checkpoint-6")
    saved = saved_callbacks(ckpt)["EarlyStoppingCallback"]
    counter = first.callback_handler.pop(EarlyStoppingCallback).early_stopping_patience_counter
    assert (
        saved["attributes"]["early_stopping_patience_counter"] == counter > 0
    )  # threshold 0.25: no improvement counts
    # HF's own callback reads kiln's saved state
    hf_cb = hf.EarlyStoppingCallback.from_state(saved)
    assert (hf_cb.early_stopping_patience, hf_cb.early_stopping_threshold) == (50, 0.25)

    resumed = train(
        out,
        {"max_steps": 6, "save_steps": 6, **EVAL, "restore_callback_states_from_checkpoint": True},
        eval_data=small_eval,
        resume=ckpt,
        callbacks=[EarlyStoppingCallback(early_stopping_patience=2)],
    )
    [es] = [cb for cb in resumed.callback_handler.callbacks if isinstance(cb, EarlyStoppingCallback)]
    assert (es.early_stopping_patience, es.early_stopping_threshold, es.early_stopping_patience_counter) == (
        50,
        0.25,
        counter,
    )

    kept = EarlyStoppingCallback(early_stopping_patience=2)
    train(out, {"max_steps": 6, "save_steps": 6, **EVAL}, eval_data=small_eval, resume=ckpt, callbacks=[kept])
    assert (kept.early_stopping_patience, kept.early_stopping_threshold, kept.early_stopping_patience_counter) == (
        2,
        0.0,
        counter,
    )


def test_state_of_a_callback_no_longer_present_is_warned_about(tmp_path, caplog, hf_propagation):
    out = str(tmp_path / "run")
    train(out, {"max_steps": 4, "save_steps": 4}, callbacks=[Steps()])
    train(out, {"max_steps": 5, "save_steps": 4}, resume=True)
    # logged in HF's words, as HF does
    assert "Checkpoint included callbacks not included in current configuration. Ignoring. (Steps" in caplog.text


def test_settings_that_differ_from_the_checkpoint_are_named(tmp_path, caplog, hf_propagation):
    out = str(tmp_path / "run")
    train(out, {"max_steps": 4, "save_steps": 4, "logging_steps": 3})
    train(out, {"max_steps": 5, "save_steps": 4, "logging_steps": 2}, resume=True)
    assert "logging_steps: 2 (from args) != 3 (from trainer_state.json)" in caplog.text  # logged, as HF does
    caplog.clear()
    train(out, {"max_steps": 6, "save_steps": 4, "logging_steps": 2}, resume=True)
    assert "do not match" not in caplog.text  # same settings: no warning
