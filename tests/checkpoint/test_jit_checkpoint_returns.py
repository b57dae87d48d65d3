"""SIGTERM with `enable_jit_checkpoint` (issue 30 item 9): HF's Trainer saves a checkpoint and its
`train()` returns as after a finished run (on_train_end runs, a TrainOutput comes back, the SIGTERM
handler is put back). kiln does the same; `kiln fit` then exits 0 without evaluating or exporting."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from kiln import cli
from kiln.engine.callbacks.base import Callback
from kiln.engine.loop.fit import TrainOutput
from kiln.engine.trainer import Trainer
from tests.checkpoint.checkpoint_helpers import config, folders, make_model, regression_data


class SigtermAfterStep(Callback):
    """Sends this process SIGTERM at the end of step `step` and counts on_train_end calls."""

    def __init__(self, step: int) -> None:
        self.step, self.ends = step, 0

    def on_step_end(self, config, state, control, **kw):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_end(self, config, state, control, **kw):
        self.ends += 1


def test_kiln_saves_then_train_returns_and_on_train_end_runs(tmp_path):
    out = str(tmp_path / "run")
    before = signal.getsignal(signal.SIGTERM)
    probe = SigtermAfterStep(3)
    trainer = Trainer(
        make_model(),
        config(out, max_steps=8, save_steps=100, enable_jit_checkpoint=True),
        train_dataset=regression_data(),
        callbacks=[probe],
    )
    result = trainer.fit()  # before: SystemExit(0) out of fit(), on_train_end skipped
    assert isinstance(result, TrainOutput) and result.global_step == 3 and "train_loss" in result.metrics
    assert probe.ends == 1
    assert folders(out) == {"checkpoint-3"}
    assert trainer.checkpoints.preempted_step == 3
    assert signal.getsignal(signal.SIGTERM) is before
    assert "train_loss" in trainer.state.log_history[-1]  # the end-of-training log, as after a finished run


def test_hf_trainer_does_the_same(tmp_path):
    """HF's own JIT checkpoint on the same kind of run: a checkpoint, train() returns, on_train_end runs."""
    transformers = pytest.importorskip("transformers")
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    class HFProbe(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.jit, self.ends = None, 0

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
                deadline = time.monotonic() + 60  # HF requests the checkpoint from a timer thread: wait for it
                while not self.jit.is_checkpoint_requested and time.monotonic() < deadline:
                    time.sleep(0.01)

        def on_train_end(self, args, state, control, **kw):
            self.ends += 1

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    )
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, 32, (8,), generator=g)), "labels": ids.clone()} for _ in range(32)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=8,
        save_steps=100,
        use_cpu=True,
        per_device_train_batch_size=2,
        report_to="none",
        disable_tqdm=True,
        enable_jit_checkpoint=True,
    )
    before = signal.getsignal(signal.SIGTERM)
    probe = HFProbe()
    hf = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[probe])
    jit = next(cb for cb in hf.callback_handler.callbacks if isinstance(cb, JITCheckpointCallback))
    jit.jit_manager.kill_wait, probe.jit = 0, jit.jit_manager
    result = hf.train()
    assert type(result).__name__ == "TrainOutput" and result.global_step < 8
    assert probe.ends == 1
    assert len(folders(str(tmp_path / "hf"))) == 1
    assert signal.getsignal(signal.SIGTERM) is before


TASK = """
import os
import signal

from kiln import Callback
from tests.checkpoint.checkpoint_helpers import make_model, regression_data


class Sigterm(Callback):
    def on_step_end(self, config, state, control, **kw):
        if state.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)


def model():
    return make_model()


def data():
    return {"train_dataset": regression_data(), "eval_dataset": regression_data(8), "callbacks": [Sigterm()]}
"""


def test_kiln_fit_exits_0_after_the_checkpoint_without_evaluating_or_exporting(tmp_path: Path, monkeypatch):
    (tmp_path / "preempttask.py").write_text(TASK)
    (tmp_path / "cfg.yaml").write_text(
        "output_dir: run\ntask: {model: 'preempttask:model', data: 'preempttask:data'}\nmax_steps: 6\n"
        "per_device_train_batch_size: 4\nsave: {strategy: steps, steps: 100, on_preemption: true}\n"
        "log: {disable_tqdm: true, history: []}\nreport_to: none\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["fit", "cfg.yaml"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before
    run = tmp_path / "run"
    assert folders(str(run)) == {"checkpoint-2"}
    assert not (run / "model.safetensors").exists() and not (run / "eval_results.json").exists()
