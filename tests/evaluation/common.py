"""Models, data and configs shared by the evaluation tests: scikit-learn's bundled digits (no
download) with a small MLP, as a kiln TrainingModule and as an HF-contract nn.Module."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from examples.digits.data import DigitsDataset, build_data
from kiln import Callback, Trainer, TrainingModule

_DIGITS: dict[str, Any] = {}


def digits(n_train: int = 64, n_eval: int = 100) -> tuple[DigitsDataset, DigitsDataset]:
    """The first `n_train` / `n_eval` rows of the example's deterministic split (kept small: fast)."""
    if not _DIGITS:
        _DIGITS.update(build_data(seed=0))
    train, evals = _DIGITS["train_dataset"], _DIGITS["eval_dataset"]
    return (
        DigitsDataset(train.pixels[:n_train], train.labels[:n_train]),
        DigitsDataset(evals.pixels[:n_eval], evals.labels[:n_eval]),
    )


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 10))


class DigitsModule(TrainingModule):
    """A TrainingModule: validation_step returns loss, logits and labels."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.net(pixels)

    def training_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(self(batch["pixels"]), batch["labels"])

    def validation_step(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits = self(batch["pixels"])
        return {"loss": F.cross_entropy(logits, batch["labels"]), "logits": logits, "labels": batch["labels"]}


class HFDigits(nn.Module):
    """The Hugging Face contract: model(**batch) returns a dict with "loss" (given labels) and "logits"."""

    main_input_name = "pixels"

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.net(pixels)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def _trained_weights() -> dict[str, torch.Tensor]:
    """An MLP fitted once per session by plain full-batch Adam (~95% eval accuracy), so that metric
    checks tell right answers from wrong ones."""
    if "weights" not in _DIGITS:
        digits()
        torch.manual_seed(0)
        net, train = _mlp(), _DIGITS["train_dataset"]
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        for _ in range(60):
            opt.zero_grad()
            F.cross_entropy(net(train.pixels), train.labels).backward()
            opt.step()
        _DIGITS["weights"] = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return _DIGITS["weights"]


def make_model(kind: str, trained: bool = True) -> nn.Module:
    """A DigitsModule ("module") or HFDigits ("hf"); both hold the same weights."""
    torch.manual_seed(0)
    model = DigitsModule() if kind == "module" else HFDigits()
    if trained:
        model.net.load_state_dict(_trained_weights())
    return model


def hand_logits(model: nn.Module, dataset: DigitsDataset) -> torch.Tensor:
    """What the model predicts for every row, computed without kiln."""
    net = model.net
    was_training = net.training
    net.eval()
    with torch.no_grad():
        logits = net(dataset.pixels)
    net.train(was_training)
    return logits


def config(tmp_path: Any, **overrides: Any) -> dict[str, Any]:
    """A quiet CPU config (no history files, no progress bar, no checkpoints) plus `overrides`."""
    cfg: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "log": {"history": [], "disable_tqdm": True},
        "save_strategy": "no",
        "strategy": {"device": "cpu"},
        "per_device_eval_batch_size": 32,
    }
    cfg.update(overrides)
    return cfg


def accuracy_score(labels, predictions) -> float:
    """scikit-learn's, imported when a test calls it (importing sklearn.metrics costs seconds at collection)."""
    from sklearn.metrics import accuracy_score

    return accuracy_score(labels, predictions)


def accuracy(eval_pred: Any) -> dict[str, float]:
    """compute_metrics written for HF: two-way unpacking of EvalPrediction."""
    logits, labels = eval_pred
    return {"accuracy": float((np.asarray(logits).argmax(-1) == np.asarray(labels)).mean())}


class Recorder(Callback):
    """Records every on_evaluate / on_predict call (step and metrics)."""

    def __init__(self) -> None:
        self.evaluations: list[tuple[int, dict[str, float]]] = []
        self.predictions: list[dict[str, float]] = []

    def on_evaluate(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        self.evaluations.append((state.global_step, dict(kw["metrics"])))

    def on_predict(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        self.predictions.append(dict(kw["metrics"]))


def eval_logs(trainer: Trainer, key: str = "eval_loss") -> list[dict[str, Any]]:
    return [entry for entry in trainer.state.log_history if key in entry]
