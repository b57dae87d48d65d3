"""`resume_from_checkpoint` raises what HF's Trainer raises for the same inputs (issue 30 item 8): a
path that is no checkpoint, and `true` with no checkpoint in output_dir, are `ValueError`s (kiln's
`ResumeError`, still a `CheckpointError`). kiln's `if_exists` keeps the lenient behaviour for
restarted jobs: the newest complete checkpoint if there is one, else a fresh start with one log line;
and a restarted attempt (torchrun, SLURM requeue) that does not resume is told how to."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.engine.checkpoint.resume import ResumeError
from kiln.engine.trainer import Trainer
from kiln.utils.errors import CheckpointError
from tests.checkpoint.checkpoint_helpers import Crash, train, weights

transformers = pytest.importorskip("transformers")


class HFRegressor(nn.Module):
    """The HF contract (keyword batch in, a loss out), which both Trainers train."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.mse_loss(self.lin(x).squeeze(-1), labels)}


def data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(4, generator=g), "labels": torch.randn((), generator=g)} for _ in range(8)]


def _empty(root: str) -> str:
    os.makedirs(os.path.join(root, "empty"))
    return os.path.join(root, "empty")


def _a_file(root: str) -> str:
    with open(os.path.join(root, "weights.txt"), "w") as fh:
        fh.write("not a checkpoint")
    return os.path.join(root, "weights.txt")


def _not_a_checkpoint(root: str) -> str:
    os.makedirs(os.path.join(root, "checkpoint-5"))
    return os.path.join(root, "checkpoint-5")


#: name -> (prepare: (scratch folder, output_dir) -> the resume_from_checkpoint value)
CASES: dict[str, Callable[[str, str], Any]] = {
    "missing path": lambda root, out: os.path.join(root, "nope"),
    "empty folder": lambda root, out: _empty(root),
    "a file": lambda root, out: _a_file(root),
    "folder without weights": lambda root, out: _not_a_checkpoint(root),
    "true, output_dir not there": lambda root, out: True,
    "true, output_dir empty": lambda root, out: os.makedirs(out) or True,
    "true, output_dir holds no checkpoint": lambda root, out: os.makedirs(os.path.join(out, "runs")) or True,
}


def _raised(fit: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as err:
        fit()
    return err.value


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_inputs_raise_what_hf_raises(tmp_path, case):
    hf_out, kiln_out = str(tmp_path / "hf" / "out"), str(tmp_path / "kiln" / "out")
    for out in (hf_out, kiln_out):
        os.makedirs(os.path.dirname(out))
    args = transformers.TrainingArguments(
        output_dir=hf_out,
        max_steps=1,
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    hf_resume = CASES[case](os.path.dirname(hf_out), hf_out)
    theirs = _raised(
        lambda: transformers.Trainer(model=HFRegressor(), args=args, train_dataset=data()).train(
            resume_from_checkpoint=hf_resume
        )
    )
    cfg = {
        "output_dir": kiln_out,
        "max_steps": 1,
        "per_device_train_batch_size": 4,
        "report_to": "none",
        "save": {"strategy": "no"},
        "disable_tqdm": True,
        "strategy": {"device": "cpu"},
    }
    kiln_resume = CASES[case](os.path.dirname(kiln_out), kiln_out)
    ours = _raised(lambda: Trainer(HFRegressor(), cfg, train_dataset=data()).fit(resume_from_checkpoint=kiln_resume))
    assert type(theirs) is ValueError, theirs  # what HF raises for every one of these inputs
    assert isinstance(ours, type(theirs)) and isinstance(ours, CheckpointError), (type(ours), ours)
    if case in ("empty folder", "folder without weights"):  # named as incomplete, before any checksum is read
        assert f"{kiln_resume} is incomplete or damaged" in str(ours), ours
    if kiln_resume is True:  # HF's sentence, which users search for
        assert str(ours).startswith(f"No valid checkpoint found in output directory ({kiln_out})"), ours
        assert "resume_from_checkpoint=if_exists" in str(ours)


def test_the_string_true_of_a_config_raises_the_same(tmp_path):
    with pytest.raises(ResumeError, match="No valid checkpoint found"):
        train(str(tmp_path / "run"), {"max_steps": 2, "resume_from_checkpoint": "true"})


CFG = {"max_steps": 4, "save_steps": 2}


def test_if_exists_without_a_checkpoint_starts_fresh_and_says_so_once(tmp_path, caplog):
    fresh = train(str(tmp_path / "fresh"), CFG)
    with caplog.at_level(logging.INFO, logger="kiln.engine.checkpoint.resume"):
        started = train(str(tmp_path / "run"), CFG, resume="if_exists")
    lines = [r.getMessage() for r in caplog.records if r.name == "kiln.engine.checkpoint.resume"]
    assert lines == [
        f"resume_from_checkpoint=if_exists: {tmp_path / 'run'} holds no complete checkpoint, so training "
        "starts from step 0."
    ]
    assert started.state.global_step == 4
    assert all(torch.equal(a, b) for a, b in zip(weights(fresh).values(), weights(started).values()))


def test_if_exists_resumes_from_the_newest_complete_checkpoint(tmp_path):
    cfg = {**CFG, "max_steps": 6}
    straight = train(str(tmp_path / "straight"), cfg)
    out = str(tmp_path / "run")
    with pytest.raises(Crash):
        train(out, cfg, crash_at=4)  # checkpoint-2 and checkpoint-4, then the process "dies"
    os.makedirs(os.path.join(out, "checkpoint-5"))  # newer, but not a complete checkpoint: skipped with a warning
    with pytest.warns(UserWarning, match="Ignoring incomplete checkpoint .*checkpoint-5"):
        resumed = train(out, cfg, model_seed=99, resume="if_exists")
    assert resumed.state.log_history[0]["step"] <= 4  # the history continued from checkpoint-4, not from step 0
    assert all(torch.equal(a, b) for a, b in zip(weights(straight).values(), weights(resumed).values()))


def test_if_exists_in_the_config_and_as_a_path_like_value(tmp_path):
    out = str(tmp_path / "run")
    train(out, CFG)
    again = train(out, {**CFG, "max_steps": 6, "resume_from_checkpoint": "if_exists"})
    assert again.state.global_step == 6 and again.state.log_history[0]["step"] <= 4


@pytest.mark.parametrize("variable", ["TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"])
def test_a_restarted_attempt_that_does_not_resume_is_told_how(tmp_path, monkeypatch, caplog, variable):
    monkeypatch.setenv(variable, "2")
    with caplog.at_level(logging.WARNING, logger="kiln.engine.checkpoint.resume"):
        train(str(tmp_path / "run"), CFG)
    said = [r.getMessage() for r in caplog.records if r.name == "kiln.engine.checkpoint.resume"]
    assert len(said) == 1 and "restart 2 of the job" in said[0] and "resume_from_checkpoint=if_exists" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln.engine.checkpoint.resume"):
        train(str(tmp_path / "run"), {**CFG, "max_steps": 6}, resume="if_exists")  # resuming: nothing to say
    assert not [r for r in caplog.records if r.name == "kiln.engine.checkpoint.resume"]
