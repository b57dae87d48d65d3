"""Which flags a step starts with, against transformers.Trainer itself: HF's CallbackHandler clears
should_log, should_evaluate and should_save before on_step_begin's callbacks run, so a save asked for
in on_epoch_begin is dropped, while one asked for in on_step_begin is kept and happens after that step."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from kiln import Callback, Trainer
from tests.engine.test_callback_flags_vs_hf import Lin, _rows

transformers = pytest.importorskip("transformers")

SETTINGS = dict(
    max_steps=3, per_device_train_batch_size=8, learning_rate=1e-2, logging_steps=10, save_strategy="no", seed=0
)


class _AsksToSave:
    """Sets should_save in `event` (on the step begin of step 2 only, for on_step_begin)."""

    def __init__(self, event: str) -> None:
        self.event = event

    def on_epoch_begin(self, args, state, control, **kw):
        if self.event == "on_epoch_begin":
            control.should_save = True

    def on_step_begin(self, args, state, control, **kw):
        if self.event == "on_step_begin" and state.global_step == 1:
            control.should_save = True


class HFAsks(_AsksToSave, transformers.TrainerCallback):
    pass


class KilnAsks(_AsksToSave, Callback):
    pass


def _checkpoints(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("checkpoint-")) if os.path.isdir(folder) else []


@pytest.mark.parametrize("event, saved", [("on_epoch_begin", []), ("on_step_begin", ["checkpoint-2"])])
def test_a_save_asked_for_before_the_step_begins_is_cleared_as_in_hf(tmp_path, event, saved):
    torch.manual_seed(0)
    model = Lin()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), use_cpu=True, report_to=[], disable_tqdm=True, **SETTINGS
    )
    transformers.Trainer(
        model=copy.deepcopy(model), args=args, train_dataset=_rows(64), callbacks=[HFAsks(event)]
    ).train()
    cfg = {
        "output_dir": str(tmp_path / "kiln"),
        "strategy": {"device": "cpu"},
        "log": {"history": [], "disable_tqdm": True},
        **SETTINGS,
    }
    Trainer(copy.deepcopy(model), cfg, train_dataset=_rows(64), callbacks=[KilnAsks(event)]).fit()
    assert _checkpoints(tmp_path / "hf") == saved
    assert _checkpoints(tmp_path / "kiln") == saved
