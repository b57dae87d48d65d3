"""kiln's DefaultFlowCallback against transformers' own, flag by flag: the same should_log / should_evaluate /
should_save / should_training_stop at every step over a grid of intervals, eval delays (the final step
evaluated off the eval grid, and not before eval_delay) and epoch ends; and HF's ratio intervals."""

from __future__ import annotations

import itertools

import pytest

from kiln.config import load_config
from kiln.engine.callbacks.base import DefaultFlowCallback, interval
from kiln.engine.callbacks.state import TrainerControl, TrainerState

transformers = pytest.importorskip("transformers")

FLAGS = ("should_log", "should_evaluate", "should_save", "should_training_stop")


def _flags(control) -> tuple:
    return tuple(getattr(control, flag) for flag in FLAGS)


@pytest.mark.parametrize("max_steps, eval_steps, first", itertools.product((4, 6, 7), (2, 3), (False, True)))
@pytest.mark.parametrize("delay_at", ["none", "last", "past"])
def test_every_step_sets_hf_s_flags(tmp_path, max_steps, eval_steps, first, delay_at):
    delay = {"none": 0, "last": max_steps, "past": max_steps + 1}[delay_at]
    settings = dict(
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=eval_steps,
        eval_delay=delay,
        save_strategy="steps",
        save_steps=3,
        logging_first_step=first,
    )
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **settings)
    theirs = transformers.trainer_callback.DefaultFlowCallback()
    config = load_config({"output_dir": str(tmp_path), **settings})
    ours = DefaultFlowCallback()
    state = TrainerState(max_steps=max_steps, logging_steps=2, eval_steps=eval_steps, save_steps=3)
    hf_state = transformers.TrainerState(max_steps=max_steps, logging_steps=2, eval_steps=eval_steps, save_steps=3)
    ours.on_train_begin(config, state, TrainerControl())
    for step in range(1, max_steps + 1):
        state.global_step = hf_state.global_step = step
        got = _flags(ours.on_step_end(config, state, TrainerControl()))
        want = _flags(theirs.on_step_end(args, hf_state, transformers.TrainerControl()))
        assert got == want, f"step {step}"


@pytest.mark.parametrize("delay, epoch", [(0, 1.0), (2, 1.0), (2, 2.0), (3, 2.0)])
def test_epoch_ends_set_hf_s_flags(tmp_path, delay, epoch):
    settings = dict(logging_strategy="epoch", eval_strategy="epoch", eval_delay=delay, save_strategy="epoch")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **settings)
    config = load_config({"output_dir": str(tmp_path), **settings})
    ours, state = DefaultFlowCallback(), TrainerState(epoch=epoch)
    ours.on_train_begin(config, state, TrainerControl())
    got = _flags(ours.on_epoch_end(config, state, TrainerControl()))
    want = _flags(
        transformers.trainer_callback.DefaultFlowCallback().on_epoch_end(
            args, transformers.TrainerState(epoch=epoch), transformers.TrainerControl()
        )
    )
    assert got == want


@pytest.mark.parametrize(
    "value, max_steps, want", [(0.1, 5, 1), (0.25, 10, 3), (0.5, 3, 2), (None, 10, 500), (7, 10, 7)]
)
def test_ratio_intervals_round_up_as_hf_does(value, max_steps, want):
    """HF: `math.ceil(max_steps * logging_steps)` for a ratio below 1, never 0."""
    assert interval(value, max_steps, 500) == want
