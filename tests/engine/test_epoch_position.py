"""The loop position a checkpoint records when training stops: at an epoch's last batch the epoch counts as
finished (the next run starts the next epoch), part-way through it does not (the next run goes on inside it).
A position off by an epoch would make a resumed run skip or repeat data (kiln/engine/loop/fit.py)."""

from __future__ import annotations

import json

import pytest
import torch

from kiln import Trainer
from tests.helpers import TinyRegressor, base_config, flat_params, regression_data

#: 24 items in batches of 4: 6 batches an epoch
DATA, BATCH = 24, 4


def _fit(tmp_path, name: str, resume: bool = False, **cfg) -> Trainer:
    torch.manual_seed(0)
    config = base_config(
        tmp_path,
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=BATCH,
        lr_scheduler_type="constant",
        learning_rate=0.05,
        save={"strategy": "epoch"},
        **cfg,
    )
    trainer = Trainer(TinyRegressor(), config, train_dataset=regression_data(DATA))
    trainer.fit(resume_from_checkpoint=True if resume else None)
    return trainer


def _position(tmp_path, name: str, step: int) -> dict[str, int]:
    with open(tmp_path / name / f"checkpoint-{step}" / "kiln_loop_position.json", encoding="utf-8") as fh:
        return json.load(fh)


@pytest.mark.parametrize(
    "cfg, step, epoch_index, batches",
    [
        ({"max_steps": 9}, 9, 1, 3),  # stopped half-way through the second epoch
        ({"max_steps": 12}, 12, 2, 0),  # stopped by max_steps at the second epoch's last batch
        ({"num_train_epochs": 2}, 12, 2, 0),  # the epochs ran out
        ({"max_steps": 6, "gradient_accumulation_steps": 2}, 6, 2, 0),  # 3 windows of 2 batches an epoch
        ({"max_steps": 4, "gradient_accumulation_steps": 2}, 4, 1, 2),  # windows count their batches
    ],
)
def test_the_saved_position_counts_an_epoch_finished_only_at_its_last_batch(tmp_path, cfg, step, epoch_index, batches):
    trainer = _fit(tmp_path, "run", **cfg)
    assert trainer.state.global_step == step
    saved = _position(tmp_path, "run", step)
    assert (saved["epoch_index"], saved["batches_into_epoch"]) == (epoch_index, batches)
    assert (trainer.state.epoch_index, trainer.state.batches_into_epoch) == (epoch_index, batches)


@pytest.mark.parametrize("first, older_file", [(9, False), (12, False), (9, True)])
def test_a_run_resumed_from_where_it_stopped_ends_like_an_uninterrupted_one(tmp_path, first, older_file):
    whole = _fit(tmp_path, "whole", max_steps=15)
    _fit(tmp_path, "parts", max_steps=first)
    if older_file:  # kiln before 2026-11-27 also wrote a `steps_into_epoch` that was always 0
        path = tmp_path / "parts" / f"checkpoint-{first}" / "kiln_loop_position.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "steps_into_epoch": 0}))
    resumed = _fit(tmp_path, "parts", resume=True, max_steps=15)
    assert resumed.state.global_step == 15
    assert torch.equal(flat_params(resumed.model), flat_params(whole.model))
