"""The "***** Running training *****" block: kiln logs HF's lines, at INFO, on the main process only,
the same numbers as transformers.Trainer logs for the same run (steps or epochs, accumulation, a
resumed run), and nothing below INFO or on another rank."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from kiln import Trainer
from kiln.engine.callbacks.state import TrainerState
from kiln.engine.loop.summary import log_training_start, num_examples
from tests.helpers import regression_data

transformers = pytest.importorskip("transformers")


class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.frozen = nn.Linear(8, 2)  # not trained: the count is of trainable parameters
        self.frozen.requires_grad_(False)

    def forward(self, x, labels=None):
        return {"loss": F.mse_loss(self.lin(x).squeeze(-1), labels)}


def _rows(n: int = 60) -> list[dict[str, torch.Tensor]]:
    return [{"x": d["x"], "labels": d["y"]} for d in regression_data(n)]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def block(self) -> list[str]:
        start = self.lines.index("***** Running training *****")
        end = start + 1
        while end < len(self.lines) and self.lines[end].startswith("  "):
            end += 1
        return self.lines[start:end]


def _capture(name: str) -> _Lines:
    handler = _Lines()
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    return handler


def _hf_block(out, model, resume=None, **settings) -> list[str]:
    handler = _capture("transformers.trainer")
    try:
        args = transformers.TrainingArguments(
            output_dir=str(out), use_cpu=True, report_to=[], disable_tqdm=True, log_level="info", **settings
        )
        transformers.Trainer(model=model, args=args, train_dataset=_rows()).train(resume_from_checkpoint=resume)
        return handler.block()
    finally:
        logging.getLogger("transformers.trainer").removeHandler(handler)


def _kiln_block(out, model, resume=None, **settings) -> list[str]:
    handler = _capture("kiln.engine.loop.summary")
    try:
        cfg = {
            "output_dir": str(out),
            "strategy": {"device": "cpu"},
            "log": {"history": [], "disable_tqdm": True},
            "log_level": "info",
            **settings,
        }
        Trainer(model, cfg, train_dataset=_rows()).fit(resume_from_checkpoint=resume)
        return handler.block()
    finally:
        logging.getLogger("kiln.engine.loop.summary").removeHandler(handler)


@pytest.mark.parametrize(
    "settings",
    [
        dict(max_steps=5, per_device_train_batch_size=4, gradient_accumulation_steps=2),  # 15 batches: 8 steps an epoch
        dict(num_train_epochs=2, per_device_train_batch_size=8, gradient_accumulation_steps=3),
    ],
)
def test_the_block_matches_hf_s(tmp_path, settings):
    model = Lin()
    theirs = _hf_block(tmp_path / "hf", copy.deepcopy(model), save_strategy="no", **settings)
    ours = _kiln_block(tmp_path / "kiln", copy.deepcopy(model), save_strategy="no", **settings)
    assert ours == theirs
    assert "  Number of trainable parameters = 9" in ours


def test_a_resumed_run_says_where_it_picks_up_as_hf_does(tmp_path):
    model = Lin()
    settings = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, save_strategy="steps", save_steps=3)
    _hf_block(tmp_path / "hf", copy.deepcopy(model), max_steps=3, **settings)
    _kiln_block(tmp_path / "kiln", copy.deepcopy(model), max_steps=3, **settings)
    theirs = _hf_block(tmp_path / "hf", copy.deepcopy(model), resume=True, max_steps=5, **settings)
    ours = _kiln_block(tmp_path / "kiln", copy.deepcopy(model), resume=True, max_steps=5, **settings)
    assert ours == theirs
    assert any(line.startswith("  Fast-forwarding the dataloader past 0 epochs and 6 batches") for line in ours)


def _fake_loop(global_zero: bool, local_zero: bool, on_each_node: bool) -> SimpleNamespace:
    cfg = OmegaConf.create(
        {
            "log": {"on_each_node": on_each_node},
            "data": {"per_device_train_batch_size": 4},
            "train": {"ignore_data_skip": False},
        }
    )
    strategy = SimpleNamespace(is_global_zero=global_zero, is_local_zero=local_zero, data_shards=2)
    run = SimpleNamespace(micro_batch_size=4, accumulation=1, model=nn.Linear(2, 1), state=TrainerState())
    return SimpleNamespace(config=cfg, run=run, strategy=strategy)


@pytest.mark.parametrize(
    "global_zero, local_zero, on_each_node, logs",
    [
        (True, True, False, True),
        (False, True, False, False),
        (False, True, True, True),
        (False, False, True, False),
    ],
)
def test_only_the_main_process_logs_it_and_only_at_info(caplog, global_zero, local_zero, on_each_node, logs):
    loop = _fake_loop(global_zero, local_zero, on_each_node)
    with caplog.at_level(logging.INFO, logger="kiln.engine.loop.summary"):
        log_training_start(loop, [0] * 5, 5, 5, 1, 5, None)
    assert ("***** Running training *****" in caplog.text) is logs
    if logs:
        assert "  Total train batch size (w. parallel, distributed & accumulation) = 8" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln.engine.loop.summary"):
        log_training_start(_fake_loop(True, True, False), [0] * 5, 5, 5, 1, 5, None)
    assert "Running training" not in caplog.text


def test_num_examples_follows_hf_s_rule_for_each_kind_of_loader():
    """HF's set_initial_training_values: the dataset's length; batches x the configured batch size when the
    dataset has none; the samples max_steps steps read (total batch x steps) when the loader has no length."""
    sized = torch.utils.data.DataLoader(_rows(10), batch_size=4)
    assert num_examples(sized, len(sized), 4, 8, 5) == len(sized.dataset)
    assert num_examples([0] * 3, 3, 4, 8, 5) == 3 * 4
    total_batch, max_steps = 8, 5
    assert num_examples(iter([]), None, 4, total_batch, max_steps) == total_batch * max_steps
