"""Optimizer param groups in HF's layout whatever the weight decay (issue 30 item 2): decayed weights,
then biases and norm weights, two groups even with weight_decay 0, as `transformers.Trainer` builds
them. HF's Trainer then resumes a kiln checkpoint, and a checkpoint of an older kiln (one group when
weight_decay was 0) still resumes here, bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from kiln.engine.trainer import Trainer
from kiln.optim import optimizers
from tests.checkpoint.checkpoint_helpers import Crash, numeric_history, train, weights
from tests.helpers import TinyRegressor, base_config

transformers = pytest.importorskip("transformers")


class TstLayer(nn.Module):
    """HF's tests/trainer/test_trainer.py TstLayer: two Linears and a LayerNorm."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(hidden_size, hidden_size)
        self.ln1 = nn.LayerNorm(hidden_size)
        self.linear2 = nn.Linear(hidden_size, hidden_size)
        self.ln2 = nn.LayerNorm(hidden_size)
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(nn.functional.relu(self.linear1(x)))
        h = nn.functional.relu(self.linear2(x))
        return self.ln2(x + h + self.bias)


def test_no_wd_param_group(tmp_path):
    """HF's own test_no_wd_param_group, against kiln's Trainer: weight_decay is left at its default 0."""
    model = nn.Sequential(TstLayer(128), nn.ModuleList([TstLayer(128), TstLayer(128)]))
    trainer = Trainer(model, base_config(tmp_path))
    trainer.create_optimizer()
    wd_names = [
        "0.linear1.weight",
        "0.linear2.weight",
        "1.0.linear1.weight",
        "1.0.linear2.weight",
        "1.1.linear1.weight",
        "1.1.linear2.weight",
    ]
    wd_params = [p for n, p in model.named_parameters() if n in wd_names]
    no_wd_params = [p for n, p in model.named_parameters() if n not in wd_names]
    assert trainer.optimizer.param_groups[0]["params"] == wd_params
    assert trainer.optimizer.param_groups[1]["params"] == no_wd_params


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_groups_and_learning_rates_are_hfs(tmp_path, weight_decay):
    torch.manual_seed(0)
    model = TinyRegressor()
    ours = Trainer(model, base_config(tmp_path, learning_rate=0.01, weight_decay=weight_decay))
    ours.create_optimizer()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True, learning_rate=0.01, weight_decay=weight_decay
    )
    hf = transformers.Trainer(model=model, args=args)
    hf.create_optimizer()
    assert ours.get_learning_rates() == hf.get_learning_rates() == [0.01, 0.01]
    for mine, theirs in zip(ours.optimizer.param_groups, hf.optimizer.param_groups, strict=True):
        assert [id(p) for p in mine["params"]] == [id(p) for p in theirs["params"]]
        assert mine["weight_decay"] == theirs["weight_decay"]


def test_an_empty_group_is_kept_as_hf_keeps_it():
    model = nn.Linear(3, 2, bias=False)  # nothing goes without decay
    groups = optimizers.parameter_groups(model, 0.0)
    assert [len(g["params"]) for g in groups] == [1, 0]
    torch.optim.AdamW(groups, lr=0.1, fused=False).step()  # torch's optimizers take an empty group


def tiny_bert(seed: int):
    cfg = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(cfg)


def bert_data():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 50, (8,), generator=g), "labels": torch.tensor(i % 2)} for i in range(32)]


def test_hf_trainer_resumes_a_kiln_checkpoint_saved_without_weight_decay(tmp_path):
    hyper = {"max_steps": 5, "save_steps": 3, "per_device_train_batch_size": 4, "learning_rate": 1e-3}
    kiln_out = str(tmp_path / "kiln")
    Trainer(
        tiny_bert(0),
        {**hyper, "output_dir": kiln_out, "report_to": "none", "disable_tqdm": True},
        train_dataset=bert_data(),
    ).fit()
    ckpt = os.path.join(kiln_out, "checkpoint-3")
    assert len(torch.load(os.path.join(ckpt, "optimizer.pt"))["param_groups"]) == 2
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", **hyper
    )
    hf = transformers.Trainer(model=tiny_bert(1), args=args, train_dataset=bert_data())
    hf.train(resume_from_checkpoint=ckpt)  # HF raised "different number of parameter groups" with kiln's one group
    assert hf.state.global_step == 5 and len(hf.optimizer.param_groups) == 2


def test_an_older_one_group_kiln_checkpoint_resumes_bitwise_in_two_groups(tmp_path, monkeypatch):
    cfg = {"max_steps": 12, "save_steps": 5, "lr_scheduler_type": "cosine", "warmup_steps": 3}
    straight = train(str(tmp_path / "straight"), cfg)
    assert [g["weight_decay"] for g in straight.optimizer.param_groups] == [0.0, 0.0]
    out = str(tmp_path / "crashed")

    def one_group(model, weight_decay):  # kiln's layout before issue 30 when weight_decay was 0
        decay, no_decay = optimizers._split_parameters(model)
        return [{"params": [p for _, p in decay + no_decay], "weight_decay": 0.0}]

    with monkeypatch.context() as m:
        m.setattr(optimizers, "parameter_groups", one_group)
        with pytest.raises(Crash):
            train(out, cfg, crash_at=5)
    assert len(torch.load(f"{out}/checkpoint-5/optimizer.pt")["param_groups"]) == 1
    resumed = train(out, cfg, model_seed=1234, resume=True)
    assert len(resumed.optimizer.param_groups) == 2
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert numeric_history(resumed) == numeric_history(straight)
