"""The objects every callback event receives (`model`, `processing_class`, `optimizer`, `lr_scheduler`,
`train_dataloader`, `eval_dataloader`), against transformers.Trainer's own: the same keys at every event,
None at the same events, and each the Trainer's live object — a callback that logs the learning rate from
`optimizer` or reads `train_dataloader` in `on_train_begin` works the same under both."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln import Trainer
from kiln.engine.callbacks.base import HF_OBJECTS, Callback
from tests.engine.test_callback_flags_vs_hf import SETTINGS, Lin, _rows

transformers = pytest.importorskip("transformers")

EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_epoch_begin",
    "on_step_begin",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_log",
    "on_evaluate",
    "on_save",
    "on_epoch_end",
    "on_train_end",
)


class _Seen:
    """Per event (first call only): the keys received, and which of HF's six objects were None."""

    def __init__(self) -> None:
        self.keys: dict[str, set] = {}
        self.none: dict[str, tuple] = {}
        self.last: dict[str, object] = {}

    def _see(self, event: str, kw: dict) -> None:
        self.last = kw
        if event not in self.keys:
            self.keys[event] = set(kw) & set(HF_OBJECTS)
            self.none[event] = tuple(name for name in HF_OBJECTS if kw.get(name) is None)


def _recorder(base: type) -> _Seen:
    methods = {event: (lambda self, args, state, control, __e=event, **kw: self._see(__e, kw)) for event in EVENTS}
    return type("Seen", (_Seen, base), methods)()


def test_every_event_receives_hf_s_objects_at_the_same_points(tmp_path):
    torch.manual_seed(0)
    model = Lin()
    theirs, ours = _recorder(transformers.TrainerCallback), _recorder(Callback)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), use_cpu=True, report_to=[], disable_tqdm=True, **SETTINGS
    )
    hf = transformers.Trainer(
        model=copy.deepcopy(model), args=args, train_dataset=_rows(64), eval_dataset=_rows(8), callbacks=[theirs]
    )
    hf.train()
    cfg = {
        "output_dir": str(tmp_path / "kiln"),
        "strategy": {"device": "cpu"},
        "log": {"history": [], "disable_tqdm": True},
        **SETTINGS,
    }
    trainer = Trainer(copy.deepcopy(model), cfg, train_dataset=_rows(64), eval_dataset=_rows(8), callbacks=[ours])
    trainer.fit()

    assert ours.keys == theirs.keys and set(ours.keys) == set(EVENTS)
    assert all(keys == set(HF_OBJECTS) for keys in ours.keys.values())
    assert ours.none == theirs.none
    # before training nothing is set up; from on_train_begin the optimizer, schedule and loader are there
    assert {"optimizer", "lr_scheduler", "train_dataloader"} <= set(ours.none["on_init_end"])
    assert ours.none["on_train_begin"] == ("processing_class", "eval_dataloader")
    # the live objects, not copies: the step's optimizer and schedule, the loader that was iterated
    last = ours.last
    assert last["optimizer"] is trainer.optimizer and last["lr_scheduler"] is trainer.lr_scheduler
    assert last["model"] is trainer.model
    assert len(last["train_dataloader"]) == 64 // SETTINGS["per_device_train_batch_size"]
    assert len(last["eval_dataloader"].dataset) == 8


def test_a_given_optimizer_pair_reaches_the_first_events(tmp_path):
    """HF builds its CallbackHandler with the `optimizers=` pair, so on_init_end already sees it."""
    torch.manual_seed(0)
    model = Lin()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ours = _recorder(Callback)
    cfg = {
        "output_dir": str(tmp_path),
        "strategy": {"device": "cpu"},
        "log": {"history": [], "disable_tqdm": True},
        "max_steps": 1,
    }
    Trainer(model, cfg, train_dataset=_rows(16), callbacks=[ours], optimizers=(opt, sched))
    assert "optimizer" not in ours.none["on_init_end"] and "lr_scheduler" not in ours.none["on_init_end"]
