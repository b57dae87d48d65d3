"""Step counts a resume must keep that equal weights alone can hide: the final checkpoint of a run that
ends in the middle of an epoch (nothing is left to train, though the epoch is unfinished), and the
step count behind `train_loss` across more than one resume (each resume adds the steps before it)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.checkpoint.checkpoint_helpers import Crash, numeric_history, train, weights


def test_resume_from_the_final_checkpoint_in_the_middle_of_an_epoch_trains_nothing(tmp_path):
    """40 samples / batch 4 = 10 batches per epoch: max_steps 7 ends 7 batches into the first epoch, so
    the resumed loop finds an unfinished epoch and must still stop before training step 8."""
    out = str(tmp_path / "run")
    cfg = {"max_steps": 7, "save_steps": 5}
    first = train(out, cfg)
    again = train(out, cfg, model_seed=99, resume=True)
    assert again.state.global_step == 7 and again.state.epoch == pytest.approx(0.7)
    a, b = weights(first), weights(again)
    assert all(torch.equal(a[n], b[n]) for n in a)  # not one update more
    assert numeric_history(again)[:-1] == numeric_history(first)[:-1]  # no new log entry, only the end's summary


def test_the_epoch_end_save_of_a_run_stopped_in_mid_epoch_keeps_its_position(tmp_path):
    """save_strategy epoch and max_steps 7 of a 10-batch epoch: the epoch-end save after the stop writes
    checkpoint-7 with the position where the run stopped (7 batches into epoch 0), not the next epoch's
    start, or a run resumed from it with a larger max_steps would skip the rest of the epoch."""
    out = str(tmp_path / "run")
    first = train(out, {"max_steps": 7, "save_strategy": "epoch", "logging_steps": 50})
    with open(os.path.join(out, "checkpoint-7", "kiln_loop_position.json"), encoding="utf-8") as fh:
        assert json.load(fh) == {"epoch_index": 0, "batches_into_epoch": 7}
    assert (first.state.epoch_index, first.state.batches_into_epoch) == (0, 7)


def test_train_loss_counts_the_steps_of_every_earlier_attempt(tmp_path):
    """Killed after step 4 and again after step 8: the third attempt's train_loss is the mean over all 12
    steps, as in the run that was never killed (a checkpoint must hold the steps of every attempt before it)."""
    cfg = {"max_steps": 12, "save_steps": 4, "logging_steps": 5}
    straight = train(str(tmp_path / "straight"), cfg)
    out = str(tmp_path / "killed")
    with pytest.raises(Crash):
        train(out, cfg, crash_at=4)
    with pytest.raises(Crash):
        train(out, cfg, model_seed=1, resume=True, crash_at=8)
    third = train(out, cfg, model_seed=2, resume=True)
    expected = straight.state.log_history[-1]["train_loss"]
    assert third.state.log_history[-1]["train_loss"] == pytest.approx(expected, rel=1e-12)
    assert numeric_history(third) == numeric_history(straight)
    a, b = weights(straight), weights(third)
    assert all(torch.equal(a[n], b[n]) for n in a)
