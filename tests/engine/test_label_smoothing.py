"""label_smoothing_factor with a multi-label classifier: HF warns and turns smoothing off, so the
model's own (binary cross-entropy) loss trains."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln import Trainer
from kiln.engine.model.label_smoothing import smoothed_loss
from tests.helpers import base_config

transformers = pytest.importorskip("transformers")


def _bert(problem_type):
    cfg = transformers.BertConfig(
        vocab_size=30,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
        num_labels=3,
        problem_type=problem_type,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def _rows(n=8):
    g = torch.Generator().manual_seed(0)
    return [
        {"input_ids": torch.randint(0, 30, (6,), generator=g), "labels": torch.randint(0, 2, (3,), generator=g).float()}
        for _ in range(n)
    ]


def test_multi_label_turns_smoothing_off_with_hfs_warning(tmp_path):
    model, rows = _bert("multi_label_classification"), _rows()
    untrained = copy.deepcopy(model)
    loader = torch.utils.data.DataLoader(rows, batch_size=len(rows))  # one batch: the logged loss is its loss
    with pytest.warns(UserWarning, match="Label smoothing is not compatible with multi-label classification"):
        trainer = Trainer(
            model, base_config(tmp_path, max_steps=1, label_smoothing_factor=0.1, logging_steps=1), train_dataset=loader
        )
    trainer.fit()
    batch = torch.utils.data.default_collate(rows)
    with torch.no_grad():
        expected = float(untrained(**batch).loss)  # the model's own BCE, unsmoothed
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged == pytest.approx([expected], rel=1e-5)


def test_single_label_keeps_smoothing(tmp_path):
    trainer = Trainer(_bert("single_label_classification"), base_config(tmp_path, label_smoothing_factor=0.1))
    assert trainer.run.facts.label_smoothing == 0.1


def test_float_labels_with_smoothing_fail_with_one_sentence():
    logits = {"logits": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match="needs class-index labels"):
        smoothed_loss(torch.nn.Linear(1, 1), logits, torch.zeros(2, 3), 0.1)
