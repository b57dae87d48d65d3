"""examples/digits: deterministic split, the TrainingModule contract, and that it learns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from examples.digits.data import accuracy, build_data
from examples.digits.model import MLPClassifier
from kiln import EvalPrediction


@pytest.fixture(scope="module")
def data() -> dict:
    return build_data(seed=0)


def test_build_data_is_deterministic_and_standardised(data: dict) -> None:
    again = build_data(seed=0)
    for split in ("train_dataset", "eval_dataset"):
        assert torch.equal(data[split].pixels, again[split].pixels)
        assert torch.equal(data[split].labels, again[split].labels)
    train, evals = data["train_dataset"], data["eval_dataset"]
    assert len(train) + len(evals) == 1797 and len(evals) == 360
    assert torch.allclose(train.pixels.mean(0), torch.zeros(64), atol=1e-5)
    assert sorted(evals.labels.unique().tolist()) == list(range(10))  # stratified
    item = train[0]
    assert item["pixels"].shape == (64,) and item["pixels"].dtype == torch.float32
    assert item["labels"].dtype == torch.long
    assert data["model_args"] == {"in_features": 64, "num_classes": 10}


def test_steps_follow_the_module_contract(data: dict) -> None:
    torch.manual_seed(0)
    model = MLPClassifier(**data["model_args"])
    batch = torch.utils.data.default_collate([data["train_dataset"][i] for i in range(8)])
    loss = model.training_step(batch)
    assert loss.dim() == 0
    assert model.num_items(batch) == 8
    out = model.validation_step(batch)
    assert set(out) == {"loss", "logits", "labels"}
    assert out["logits"].shape == (8, 10) and torch.equal(out["labels"], batch["labels"])


def test_loss_decreases_in_a_plain_loop(data: dict) -> None:
    torch.manual_seed(0)
    model = MLPClassifier(**data["model_args"])
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    loader = torch.utils.data.DataLoader(
        data["train_dataset"], batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    losses = []
    for _, batch in zip(range(20), loader):
        loss = model.training_step(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert np.mean(losses[-3:]) < 0.6 * losses[0], losses


def test_accuracy_metric() -> None:
    logits = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    assert accuracy(EvalPrediction(logits, np.array([1, 0, 0]))) == {"accuracy": pytest.approx(2 / 3)}
    assert accuracy((logits, np.array([1, 0, 1]))) == {"accuracy": 1.0}
