"""trainer_state.json is written byte for byte as HF writes it (tools diff and parse these files), a NaN in the
log history included, and the loop position file fills a key it lacks with 0."""

from __future__ import annotations

import math

import pytest

from kiln.engine.callbacks.state import TrainerState


def _state() -> TrainerState:
    return TrainerState(
        epoch=1.5,
        global_step=9,
        max_steps=12,
        logging_steps=3,
        total_flos=12.0,
        log_history=[{"loss": 0.5, "step": 3}, {"loss": math.nan, "grad_norm": math.inf, "step": 6}],
        best_metric=0.25,
        trial_params={"lr": 0.1},
        epoch_index=1,
        batches_into_epoch=3,
    )


def test_trainer_state_json_is_hfs_text_nan_included(tmp_path):
    hf = pytest.importorskip("transformers")
    ours = tmp_path / "kiln.json"
    _state().save_to_json(str(ours))
    theirs = tmp_path / "hf.json"
    hf.TrainerState.load_from_json(str(ours)).save_to_json(str(theirs))
    assert ours.read_text() == theirs.read_text()
    assert '"loss": NaN' in ours.read_text()
    back = TrainerState.load_from_json(str(ours))
    assert math.isnan(back.log_history[1]["loss"]) and back.log_history[1]["grad_norm"] == math.inf
    assert (back.epoch_index, back.batches_into_epoch) == (0, 0)  # the position is not in this file


def test_a_loop_position_missing_a_key_reads_it_as_0():
    state = _state()
    state.set_loop_position({"epoch_index": 2})
    assert state.loop_position() == {"epoch_index": 2, "batches_into_epoch": 0}
