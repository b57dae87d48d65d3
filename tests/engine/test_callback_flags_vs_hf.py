"""trainer_state.json's `stateful_callbacks` against transformers.Trainer's own: the same entries,
`TrainerControl` among them with the flags as they stand when each checkpoint is written (HF's
CallbackHandler clears should_log in on_log, should_evaluate in on_evaluate, ... and kiln's does the
same, which these flags show); and a duplicate callback is logged, not raised as a Python warning."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln import EarlyStoppingCallback, Trainer
from kiln.engine.callbacks.base import Callback, CallbackHandler
from kiln.engine.callbacks.state import TrainerControl
from tests.helpers import regression_data
from tests.hf_logs import hf_propagation  # noqa: F401 - a fixture

transformers = pytest.importorskip("transformers")

SETTINGS = dict(
    max_steps=4,
    per_device_train_batch_size=8,
    learning_rate=1e-2,
    logging_steps=1,
    eval_strategy="steps",
    eval_steps=2,
    save_strategy="steps",
    save_steps=2,
    metric_for_best_model="loss",
    seed=0,
)


class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x, labels=None):
        return {"loss": F.mse_loss(self.lin(x).squeeze(-1), labels)}


def _rows(n: int) -> list[dict[str, torch.Tensor]]:
    return [{"x": d["x"], "labels": d["y"]} for d in regression_data(n)]


class _Flags:
    """Records the flags each event sees (HF clears some before calling it)."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def _note(self, event, state, control):
        self.seen.append(
            (
                event,
                state.global_step,
                control.should_log,
                control.should_evaluate,
                control.should_save,
                control.should_training_stop,
            )
        )

    def on_log(self, args, state, control, **kw):
        self._note("log", state, control)

    def on_evaluate(self, args, state, control, **kw):
        self._note("evaluate", state, control)

    def on_save(self, args, state, control, **kw):
        self._note("save", state, control)

    def on_step_begin(self, args, state, control, **kw):
        self._note("step_begin", state, control)


class HFFlags(_Flags, transformers.TrainerCallback):
    pass


class KilnFlags(_Flags, Callback):
    pass


def _saved(folder) -> dict:
    return json.loads((folder / "trainer_state.json").read_text())["stateful_callbacks"]


def test_checkpoints_carry_trainer_control_and_events_see_hf_s_flags(tmp_path):
    torch.manual_seed(0)
    model = Lin()
    hf_flags, kiln_flags = HFFlags(), KilnFlags()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), use_cpu=True, report_to=[], disable_tqdm=True, **SETTINGS
    )
    hf = transformers.Trainer(
        model=copy.deepcopy(model),
        args=args,
        train_dataset=_rows(64),
        eval_dataset=_rows(8),
        callbacks=[hf_flags, transformers.EarlyStoppingCallback(early_stopping_patience=5)],
    )
    hf.train()
    cfg = {
        "output_dir": str(tmp_path / "kiln"),
        "strategy": {"device": "cpu"},
        "log": {"history": [], "disable_tqdm": True},
        **SETTINGS,
    }
    Trainer(
        copy.deepcopy(model),
        cfg,
        train_dataset=_rows(64),
        eval_dataset=_rows(8),
        callbacks=[kiln_flags, EarlyStoppingCallback(early_stopping_patience=5)],
    ).fit()

    assert kiln_flags.seen == hf_flags.seen
    for step in (2, 4):
        ours, theirs = _saved(tmp_path / "kiln" / f"checkpoint-{step}"), _saved(tmp_path / "hf" / f"checkpoint-{step}")
        assert ours == theirs
        assert theirs["TrainerControl"]["args"]["should_save"] is True  # written while saving
    assert _saved(tmp_path / "kiln" / "checkpoint-4")["TrainerControl"]["args"]["should_training_stop"] is True
    # HF's own classes read it back
    transformers.TrainerControl.from_state(_saved(tmp_path / "kiln" / "checkpoint-4")["TrainerControl"])
    assert TrainerControl.from_state(TrainerControl(should_log=True).state()) == TrainerControl(should_log=True)


def test_a_duplicate_callback_is_logged_not_warned(caplog, hf_propagation):
    class Once(Callback):
        pass

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Python warning would fail here
        CallbackHandler([Once(), Once()])
    [record] = [r for r in caplog.records if f"You are adding a {Once} to the callbacks" in r.getMessage()]
    assert (
        record.levelname == "WARNING" and record.name == "transformers.trainer_callback"
    )  # HF's, as transformers is imported


def test_a_saved_trainer_control_is_not_reported_as_a_missing_callback():
    """HF's checkpoints (and kiln's) hold "TrainerControl" beside the callbacks: it has no callback to go to."""
    saved = {"TrainerControl": TrainerControl(should_save=True).state()}
    assert CallbackHandler([]).load_state_dict(saved) == []
