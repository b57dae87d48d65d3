"""trainer_state.json keeps Hugging Face's schema exactly, so HF's own `TrainerState.load_from_json`
(and every tool built on it) reads a kiln checkpoint; kiln's loop position lives in its own file, and
checkpoints of older kiln versions (position inside trainer_state.json) still resume exactly."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kiln.engine.checkpoint.files import MARKER, POSITION, _fsync_tree
from tests.checkpoint.checkpoint_helpers import Crash, numeric_history, train, weights


def test_trainer_state_json_loads_with_transformers(tmp_path):
    hf = pytest.importorskip("transformers")
    out = str(tmp_path / "run")
    train(out, {"max_steps": 13, "save_steps": 13})  # 10 batches per epoch: step 13 is mid-epoch
    ckpt = os.path.join(out, "checkpoint-13")
    state = hf.TrainerState.load_from_json(os.path.join(ckpt, "trainer_state.json"))
    assert state.global_step == 13 and state.max_steps == 13
    with open(os.path.join(ckpt, POSITION), encoding="utf-8") as fh:
        assert json.load(fh) == {"epoch_index": 1, "batches_into_epoch": 3}


def _as_old_kiln_checkpoint(ckpt: str) -> None:
    """Rewrite a checkpoint the way kiln wrote it before: position inside trainer_state.json."""
    with open(os.path.join(ckpt, POSITION), encoding="utf-8") as fh:
        position = json.load(fh)
    os.remove(os.path.join(ckpt, POSITION))
    state_file = os.path.join(ckpt, "trainer_state.json")
    with open(state_file, encoding="utf-8") as fh:
        state = json.load(fh)
    with open(state_file, "w", encoding="utf-8") as fh:
        json.dump({**state, **position}, fh)
    with open(os.path.join(ckpt, MARKER), encoding="utf-8") as fh:
        marker = json.load(fh)
    os.remove(os.path.join(ckpt, MARKER))
    marker["files"], _ = _fsync_tree(ckpt)
    marker.pop("xxh3_64", None)  # older kiln versions recorded sizes only, and no marker version
    marker.pop("version", None)
    with open(os.path.join(ckpt, MARKER), "w", encoding="utf-8") as fh:
        json.dump(marker, fh)


def test_old_kiln_checkpoint_with_position_in_trainer_state_still_resumes_exactly(tmp_path):
    cfg = {"max_steps": 25, "save_steps": 13}
    straight = train(str(tmp_path / "straight"), cfg)
    out = str(tmp_path / "crashed")
    with pytest.raises(Crash):
        train(out, cfg, crash_at=13)
    _as_old_kiln_checkpoint(os.path.join(out, "checkpoint-13"))
    resumed = train(out, cfg, model_seed=99, resume=True)
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert numeric_history(resumed) == numeric_history(straight)


def test_log_history_of_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """Step entries hold HF's keys only (throughput goes to the loggers), so nothing timing-dependent
    separates the two histories but the end-of-training summary."""
    cfg = {"max_steps": 12, "save_steps": 5}
    straight = train(str(tmp_path / "straight"), cfg)
    out = str(tmp_path / "crashed")
    with pytest.raises(Crash):
        train(out, cfg, crash_at=5)
    resumed = train(out, cfg, model_seed=99, resume=True)
    steps = [e for e in straight.state.log_history if "loss" in e]
    assert steps and all(set(e) == {"loss", "grad_norm", "learning_rate", "epoch", "step"} for e in steps)
    assert resumed.state.log_history[:-1] == straight.state.log_history[:-1]
    assert "train_runtime" in straight.state.log_history[-1]
