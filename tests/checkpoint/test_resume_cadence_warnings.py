"""Resuming with other logging / eval / save steps or another per-device batch size (issue 30 item 12):
HF's Trainer warns, naming each (`compare_trainer_and_checkpoint_args`, against trainer_state.json);
kiln gives the same warning through its logger, for its own checkpoints and for HF's."""

from __future__ import annotations

import logging
import os
import re

import pytest
import torch

from kiln.engine.trainer import Trainer
from tests.checkpoint.checkpoint_helpers import train
from tests.hf_logs import hf_propagation, records  # noqa: F401 - a fixture

KILN = "kiln.engine.checkpoint.hf_checkpoint"
HF = (
    "transformers.trainer_utils"  # HF's compare_trainer_and_checkpoint_args logs there; so does kiln, with transformers
)


def named(records: list[logging.LogRecord]) -> set[str]:
    """The argument names the mismatch warnings among `records` list ("\\n\\tname: new (from args) != ...")."""
    text = "\n".join(
        r.getMessage() for r in records if "do not match the ones in the `trainer_state.json`" in r.getMessage()
    )
    return set(re.findall(r"\t(\w+): \S+ \(from args\)", text))


def kiln_warnings(caplog) -> list[logging.LogRecord]:
    return records(caplog, KILN, HF)


def test_a_kiln_checkpoint_names_each_changed_setting(tmp_path, caplog, hf_propagation):
    out = str(tmp_path / "run")
    train(out, {"max_steps": 4, "save_steps": 4, "logging_steps": 3, "eval_steps": 1, "per_device_train_batch_size": 4})
    with caplog.at_level(logging.WARNING, logger="kiln"):
        train(
            out,
            {"max_steps": 6, "save_steps": 4, "logging_steps": 2, "eval_steps": 1, "per_device_train_batch_size": 2},
            resume=True,
        )
    records = kiln_warnings(caplog)
    assert len(records) == 1, caplog.text
    assert named(records) == {"logging_steps", "per_device_train_batch_size"}
    assert "logging_steps: 2 (from args) != 3 (from trainer_state.json)" in records[0].getMessage()
    assert "per_device_train_batch_size: 2 (from args) != 4 (from trainer_state.json)" in records[0].getMessage()


def test_unchanged_settings_and_an_equal_ratio_say_nothing(tmp_path, caplog, hf_propagation):
    out = str(tmp_path / "run")
    train(out, {"max_steps": 8, "save_steps": 4, "logging_steps": 2, "eval_steps": 2})
    with caplog.at_level(logging.WARNING, logger="kiln"):
        # 0.25 of 8 steps is the 2 the checkpoint records (HF compares 0.25 with 2 and warns)
        train(out, {"max_steps": 8, "save_steps": 0.5, "logging_steps": 0.25, "eval_steps": 2}, resume=True)
    assert not kiln_warnings(caplog)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        train(out, {"max_steps": 10, "save_steps": 0.5, "logging_steps": 2}, resume=True)  # 0.5 of 10 is 5, not 4
    assert named(kiln_warnings(caplog)) == {"save_steps"}


def test_a_ratio_counts_in_epochs_too(tmp_path, caplog, hf_propagation):
    """Without max_steps the run's length comes from the data: 40 samples / 4 = 10 steps per epoch."""
    out = str(tmp_path / "run")
    train(out, {"max_steps": -1, "num_train_epochs": 1, "save_steps": 0.5, "logging_steps": 5})
    with caplog.at_level(logging.WARNING, logger="kiln"):
        train(out, {"max_steps": -1, "num_train_epochs": 1, "save_steps": 0.3, "logging_steps": 0.5}, resume=True)
    assert named(kiln_warnings(caplog)) == {"save_steps"}  # 0.3 of 10 is 3, not 5; 0.5 of 10 is the saved 5


def test_an_hf_checkpoint_is_judged_as_hf_judges_it(tmp_path, caplog, hf_propagation):
    """HF's Trainer and kiln resume the same HF checkpoint with the same changed arguments: both warn,
    naming the same arguments."""
    transformers = pytest.importorskip("transformers")

    def model():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
        )

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, 32, (8,), generator=g)), "labels": ids.clone()} for _ in range(16)]
    common = {"use_cpu": True, "report_to": "none", "disable_tqdm": True, "learning_rate": 1e-3}
    hf_out = str(tmp_path / "hf")
    saved = {"max_steps": 2, "save_steps": 2, "logging_steps": 1, "eval_steps": 1, "per_device_train_batch_size": 4}
    transformers.Trainer(
        model=model(), args=transformers.TrainingArguments(output_dir=hf_out, **common, **saved), train_dataset=data
    ).train()
    checkpoint = os.path.join(hf_out, "checkpoint-2")
    changed = {"max_steps": 3, "save_steps": 3, "logging_steps": 1, "eval_steps": 2, "per_device_train_batch_size": 2}

    with caplog.at_level(logging.WARNING):  # HF's warning reaches caplog (hf_propagation)
        args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf2"), **common, **changed)
        transformers.Trainer(model=model(), args=args, train_dataset=data).train(resume_from_checkpoint=checkpoint)
    hf_named = named([r for r in caplog.records if r.name == HF])
    assert hf_named == {"save_steps", "eval_steps", "per_device_train_batch_size"}  # what HF itself says
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln"), pytest.warns(UserWarning, match="Hugging Face checkpoint"):
        Trainer(
            model(),
            {"output_dir": str(tmp_path / "kiln"), **common, **changed, "log": {"history": []}},
            train_dataset=data,
        ).fit(resume_from_checkpoint=checkpoint)
    assert named(kiln_warnings(caplog)) == hf_named
