"""scikit-learn's bundled handwritten digits (1,797 8x8 images, shipped inside the package: nothing is
downloaded), standardised with the training split's statistics, split once with a fixed seed.

`build_data` is the `task.data` callable of `config.yaml`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


class DigitsDataset(Dataset):
    """Rows of {"pixels": float32[64], "labels": int64}."""

    def __init__(self, pixels: np.ndarray, labels: np.ndarray) -> None:
        self.pixels = torch.as_tensor(pixels, dtype=torch.float32)
        self.labels = torch.as_tensor(labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"pixels": self.pixels[index], "labels": self.labels[index]}


def accuracy(eval_pred: Any) -> dict[str, float]:
    """`compute_metrics`: argmax of the logits against the label ids, from an EvalPrediction or a
    (logits, labels) tuple."""
    logits, labels = np.asarray(eval_pred[0]), np.asarray(eval_pred[1])
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def build_data(eval_fraction: float = 0.2, seed: int = 0) -> dict[str, Any]:
    """Stratified train/eval split (the same for the same seed); features standardised with the
    training mean and standard deviation, so no eval statistics leak into training."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_eval, y_train, y_eval = train_test_split(x, y, test_size=eval_fraction, random_state=seed, stratify=y)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    std[std == 0] = 1.0  # border pixels that are always blank
    return {
        "train_dataset": DigitsDataset((x_train - mean) / std, y_train),
        "eval_dataset": DigitsDataset((x_eval - mean) / std, y_eval),
        "compute_metrics": accuracy,
        "model_args": {"in_features": x.shape[1], "num_classes": int(y.max()) + 1},
    }
