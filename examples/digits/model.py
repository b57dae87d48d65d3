"""A multi-layer perceptron classifier written as a kiln `TrainingModule`."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kiln.engine.model.module import TrainingModule


class MLPClassifier(TrainingModule):
    """`num_hidden_layers` blocks of Linear -> GELU -> Dropout, then a linear head over the classes."""

    def __init__(
        self,
        in_features: int = 64,
        num_classes: int = 10,
        hidden_size: int = 128,
        num_hidden_layers: int = 2,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(num_hidden_layers):
            layers += [nn.Linear(width, hidden_size), nn.GELU(), nn.Dropout(dropout)]
            width = hidden_size
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Class logits [batch, num_classes]."""
        return self.net(pixels)

    def training_step(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over the samples of the batch."""
        return F.cross_entropy(self(batch["pixels"]), batch["labels"])

    def validation_step(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits = self(batch["pixels"])
        return {"loss": F.cross_entropy(logits, batch["labels"]), "logits": logits, "labels": batch["labels"]}

    def num_items(self, batch: Mapping[str, torch.Tensor]) -> int:
        """Samples the loss averages over."""
        return len(batch["labels"])
