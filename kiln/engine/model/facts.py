"""What the engine derives from a model once, when a run adopts it: how it is called, what its
labels are, how a batch's items are counted and whether it divides its loss by an item count itself
(HF's `model_accepts_loss_kwargs` rule)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.engine.model.label_smoothing import label_smoothing_factor
from kiln.engine.model.module import (
    default_label_names,
    forward_argument_names,
    is_training_module,
    item_counter,
    model_accepts_loss_kwargs,
)


@dataclass(frozen=True)
class ModelFacts:
    #: a kiln TrainingModule (called as `module(batch)`), not an HF-contract model (`model(**batch)`)
    training_module: bool
    label_names: list[str]
    #: the names `forward` takes (None: anything), for `remove_unused_columns`
    forward_names: set[str] | None
    #: HF passes `num_items_in_batch` and the model divides its summed loss by it
    accepts_num_items: bool
    count_items: Callable[[Any], int | torch.Tensor]
    label_smoothing: float

    @classmethod
    def of(cls, model: nn.Module, config: Any) -> ModelFacts:
        module = is_training_module(model)
        labels = (
            list(config.data.label_names)
            if config.data.label_names
            else (["labels"] if module else default_label_names(model))
        )
        return cls(
            training_module=module,
            label_names=labels,
            forward_names=None if module else forward_argument_names(model),
            accepts_num_items=not module and model_accepts_loss_kwargs(model),
            count_items=model.num_items if is_training_module(model) else item_counter(model, labels),
            label_smoothing=label_smoothing_factor(
                model, config.train.label_smoothing_factor
            ),  # 0 for multi-label (HF)
        )

    def model_divides(self, batch: Any) -> bool:
        """HF passes num_items_in_batch (and the model divides by it) only when the batch has `labels`."""
        return self.accepts_num_items and isinstance(batch, Mapping) and "labels" in batch
