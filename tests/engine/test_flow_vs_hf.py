"""The control-flag sequence of kiln's DefaultFlowCallback against transformers.Trainer's own, recorded
by the same callback in both: evaluation at a final step off the eval_steps grid, and one save (at the
epoch end) when max_steps ends mid-epoch with save_strategy epoch."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from torch import nn

from kiln import Trainer
from kiln.engine.callbacks.base import Callback
from tests.helpers import base_config, regression_data

transformers = pytest.importorskip("transformers")


class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x, labels=None):
        return {"loss": F.mse_loss(self.lin(x).squeeze(-1), labels)}


def _rows(n):
    return [{"x": d["x"], "labels": d["y"]} for d in regression_data(n)]


class _Record:
    def __init__(self) -> None:
        self.flags: list[tuple] = []

    def on_step_end(self, args, state, control, **kw):
        self.flags.append(("step_end", state.global_step, control.should_save, control.should_evaluate))

    def on_epoch_end(self, args, state, control, **kw):
        self.flags.append(("epoch_end", state.global_step, control.should_save, control.should_evaluate))

    def on_save(self, args, state, control, **kw):
        self.flags.append(("save", state.global_step))

    def on_evaluate(self, args, state, control, **kw):
        self.flags.append(("evaluate", state.global_step))


class HFRecord(_Record, transformers.TrainerCallback):
    pass


class KilnRecord(_Record, Callback):
    pass


def _hf(tmp_path, **kw):
    rec = HFRecord()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        use_cpu=True,
        per_device_train_batch_size=4,
        report_to=[],
        disable_tqdm=True,
        logging_strategy="no",
        **kw,
    )
    transformers.Trainer(
        model=Lin(), args=args, train_dataset=_rows(16), eval_dataset=_rows(8), callbacks=[rec]
    ).train()
    return rec.flags


def _kiln(tmp_path, **kw):
    rec = KilnRecord()
    cfg = base_config(tmp_path, per_device_train_batch_size=4, logging_strategy="no", **kw)
    cfg.pop("save")
    Trainer(Lin(), cfg, train_dataset=_rows(16), eval_dataset=_rows(8), callbacks=[rec]).fit()
    return rec.flags


def test_final_step_off_the_eval_grid_is_evaluated_as_in_hf(tmp_path):
    kw = dict(max_steps=5, eval_strategy="steps", eval_steps=3, save_strategy="no")
    theirs, ours = _hf(tmp_path, **kw), _kiln(tmp_path, **kw)
    assert [f for f in ours if f[0] == "evaluate"] == [("evaluate", 3), ("evaluate", 5)]
    assert ours == theirs


def test_save_strategy_epoch_with_max_steps_mid_epoch_saves_once_as_in_hf(tmp_path):
    kw = dict(max_steps=6, save_strategy="epoch")  # 4 steps per epoch: training stops 2 steps into epoch 2
    theirs, ours = _hf(tmp_path, **kw), _kiln(tmp_path, **kw)
    assert [f for f in ours if f[0] == "save"] == [("save", 4), ("save", 6)]
    assert ("step_end", 6, False, False) in ours  # the flag is raised once, at the epoch end
    assert ours == theirs
