"""Preemption on one process: a real SIGTERM mid-step makes kiln save that step's checkpoint, stop
training (fit() returns, as HF's train() does) and put the previous handler back; resuming ends exactly like a run that never stopped. (The
2-process version, where only one rank is signalled, is tests/distributed/test_ddp_preemption.py.)"""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch

from kiln.engine.callbacks.base import Callback
from tests.checkpoint.checkpoint_helpers import folders, numeric_history, train, weights


class SigtermAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, config, state, control, **kw):
        if state.global_step + 1 == self.step:  # arrives in the middle of this step
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("name", ["enable_jit_checkpoint", "save.on_preemption"])
def test_sigterm_saves_the_step_stops_and_resumes_exactly(tmp_path, name, caplog):
    cfg = {"max_steps": 12, "save_steps": 100}
    straight = train(str(tmp_path / "straight"), cfg)
    out = str(tmp_path / "preempted")
    on = {"enable_jit_checkpoint": True} if name == "enable_jit_checkpoint" else {"save": {"on_preemption": True}}
    before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.WARNING):
        preempted = train(out, {**cfg, **on}, callbacks=[SigtermAt(5)])  # fit() returns, as HF's train() does
    assert "Preempted (SIGTERM): saved checkpoint-5 on every rank; training stops here" in caplog.text
    assert preempted.state.global_step == 5
    assert signal.getsignal(signal.SIGTERM) is before  # kiln's handler is gone again
    assert folders(out) == {"checkpoint-5"}
    resumed = train(out, cfg, model_seed=9, resume=True)
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert numeric_history(resumed) == numeric_history(straight)


def test_without_the_option_sigterm_is_left_to_its_usual_handler(tmp_path):
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        train(str(tmp_path / "run"), {"max_steps": 6, "save_steps": 100}, callbacks=[SigtermAt(3)])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [signal.SIGTERM] and folders(str(tmp_path / "run")) == {"checkpoint-6"}
