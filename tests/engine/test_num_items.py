"""Which models get `num_items_in_batch` (HF's rule) and what the step's gradient then is: with
accumulation over micro-batches of different sizes, every kind of model trains on the whole window's
mean loss, whether the model divides by the count itself or kiln weights its mean."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from kiln import Trainer
from kiln.engine.model.module import model_accepts_loss_kwargs
from tests.helpers import base_config, flat_params, regression_data


class KwargsModel(nn.Module):
    """A Transformers-5-style forward: `**kwargs`, and its loss divides by num_items_in_batch when given."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.seen: list[object] = []

    def forward(self, x, labels=None, **kwargs):
        n = kwargs.get("num_items_in_batch")
        self.seen.append(n)
        err = (self.lin(x).squeeze(-1) - labels) ** 2
        return {"loss": err.mean() if n is None else err.sum() / n}


class PositionsModel(nn.Module):
    """Takes **kwargs but its targets are not called `labels` (like HF's question answering): HF passes no
    count then, and the model's loss is its own micro-batch mean."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.seen: list[object] = []

    def forward(self, x, targets=None, **kwargs):
        self.seen.append(kwargs.get("num_items_in_batch"))
        return {"loss": F.mse_loss(self.lin(x).squeeze(-1), targets)}


def _reference(model: nn.Module, data, lr: float) -> torch.Tensor:
    """One SGD step on the mean loss over the whole window, by hand."""
    model = copy.deepcopy(model)
    x = torch.stack([d["x"] for d in data])
    y = torch.stack([d["y"] for d in data])
    F.mse_loss(model.lin(x).squeeze(-1), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return flat_params(model)


def _one_step(tmp_path, model, rows, micro_sizes):
    # a loader with uneven micro-batches: 1 then 3 rows, so per-micro-batch means are weighted wrongly
    batches = [list(range(0, micro_sizes[0])), list(range(micro_sizes[0], sum(micro_sizes)))]
    loader = torch.utils.data.DataLoader(rows, batch_sampler=batches)
    cfg = base_config(
        tmp_path,
        max_steps=1,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        gradient_accumulation_steps=2,
        max_grad_norm=0,
    )
    Trainer(model, cfg, train_dataset=loader).fit()
    return flat_params(model)


def test_kwargs_forward_gets_the_window_count_and_divides_by_it(tmp_path):
    data = regression_data(4)
    torch.manual_seed(0)
    model = KwargsModel()
    expected = _reference(model, data, 0.1)
    rows = [{"x": d["x"], "labels": d["y"]} for d in data]
    got = _one_step(tmp_path, model, rows, (1, 3))
    assert [int(n) for n in model.seen] == [4, 4]  # the whole window's items, in each micro-batch
    assert torch.allclose(got, expected, atol=1e-6)


def test_kwargs_forward_without_labels_gets_no_count_and_is_weighted_by_kiln(tmp_path):
    data = regression_data(4)
    torch.manual_seed(0)
    model = PositionsModel()
    expected = _reference(model, data, 0.1)
    rows = [{"x": d["x"], "targets": d["y"]} for d in data]
    got = _one_step(tmp_path, model, rows, (1, 3))
    assert model.seen == [None, None]
    assert torch.allclose(got, expected, atol=1e-6)


def test_accepts_loss_kwargs_attribute_wins_as_in_hf(tmp_path):
    model = KwargsModel()
    assert model_accepts_loss_kwargs(model)
    model.accepts_loss_kwargs = False  # a model whose loss ignores the count opts out, as in HF
    assert not model_accepts_loss_kwargs(model)
    data = regression_data(4)
    torch.manual_seed(0)
    model = KwargsModel()
    model.accepts_loss_kwargs = False
    expected = _reference(model, data, 0.1)
    got = _one_step(tmp_path, model, [{"x": d["x"], "labels": d["y"]} for d in data], (1, 3))
    assert model.seen == [None, None] and torch.allclose(got, expected, atol=1e-6)


def test_explicit_num_items_argument_still_counts():
    class Explicit(nn.Module):
        def forward(self, x, labels=None, num_items_in_batch=None):
            return x

    class Plain(nn.Module):
        def forward(self, x, labels=None):
            return x

    assert model_accepts_loss_kwargs(Explicit()) and not model_accepts_loss_kwargs(Plain())
