"""What evaluation and prediction hand back, with Hugging Face's names and shapes so that a
`compute_metrics` written for `transformers.Trainer` runs unchanged on kiln.

- `EvalPrediction` is the single argument of `compute_metrics`.
- `PredictionOutput` is what `Trainer.predict` returns.
- `EvalLoopOutput` is what the evaluation loop returns to `evaluate`/`predict`.
- `step_outputs`, `eval_prediction`, `to_python` turn one step's tensors into the loop's keys, build
  the `compute_metrics` argument, and make metric values plain numbers.

Arrays are numpy (or nested tuples/lists/dicts of numpy arrays) once the loop has gathered them; with
`batch_eval_metrics` they are the current batch's tensors instead, exactly as in HF.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

# A gathered output: one array, or a nested tuple/list/dict of them (models with several heads).
Arrays = np.ndarray | tuple[Any, ...] | list[Any] | dict[str, Any]


class EvalPrediction:
    """Evaluation output passed to `compute_metrics(eval_pred)`.

    It unpacks like a tuple, as HF's does: `predictions, labels = eval_pred` works, and `eval_pred[0]`
    is the predictions. `inputs` (with `include_inputs_for_metrics`) and `losses` join the tuple only
    when they are set, so two-way unpacking keeps working for the common case. Unlike HF, negative
    indices and slices behave as on a tuple instead of raising.
    """

    __slots__ = ("predictions", "label_ids", "inputs", "losses")

    def __init__(
        self,
        predictions: Any,
        label_ids: Any,
        inputs: Any | None = None,
        losses: Any | None = None,
    ) -> None:
        self.predictions = predictions
        self.label_ids = label_ids
        self.inputs = inputs
        self.losses = losses

    @property
    def elements(self) -> tuple[Any, ...]:
        """The tuple view: `(predictions, label_ids[, inputs][, losses])`."""
        extra = tuple(x for x in (self.inputs, self.losses) if x is not None)
        return (self.predictions, self.label_ids, *extra)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.elements)

    def __getitem__(self, index: int | slice) -> Any:
        return self.elements[index]

    def __len__(self) -> int:
        return len(self.elements)

    def __repr__(self) -> str:
        def shape(x: Any) -> str:
            return str(tuple(x.shape)) if hasattr(x, "shape") else type(x).__name__

        fields = ", ".join(f"{name}={shape(getattr(self, name))}" for name in self.__slots__)
        return f"EvalPrediction({fields})"


class PredictionOutput(NamedTuple):
    """`Trainer.predict` result. `label_ids` and `metrics` are None when the data has no labels;
    `predictions` is None when the model returns no logits (or with `eval.prediction_loss_only`)."""

    predictions: Arrays | None
    label_ids: Arrays | None
    metrics: dict[str, float] | None


class EvalLoopOutput(NamedTuple):
    """The evaluation loop's result: gathered arrays in dataset order, metrics, and the sample count."""

    predictions: Arrays | None
    label_ids: Arrays | None
    metrics: dict[str, float] | None
    num_samples: int | None


# -- helpers of the evaluation loop --------------------------------------------------------------
def step_outputs(loss: Any, logits: Any, labels: Any, inputs: Any, batch_size: int) -> dict[str, Any]:
    """One eval step's (nested) tensors under the keys the loop accumulates: `losses`, `predictions`,
    `label_ids`, `inputs`; None values are left out. A scalar loss becomes one value per sample (the
    batch mean repeated, as HF), so the final mean weights every batch by its size."""
    out: dict[str, Any] = {}
    if loss is not None:
        loss = loss.detach().float()
        out["losses"] = loss if loss.ndim == 1 and loss.numel() == batch_size else loss.mean().repeat(batch_size)
    for key, value in (("predictions", logits), ("label_ids", labels), ("inputs", inputs)):
        if value is not None:
            out[key] = value
    return out


def eval_prediction(outputs: Mapping[str, Any]) -> EvalPrediction:
    """The `compute_metrics` argument for accumulated outputs. Losses stay out: EvalPrediction would
    append them to its tuple and break `predictions, labels = eval_pred`."""
    return EvalPrediction(outputs.get("predictions"), outputs.get("label_ids"), inputs=outputs.get("inputs"))


def to_python(value: Any) -> Any:
    """numpy / torch scalars (0-d arrays too) -> Python numbers, for JSON files and loggers."""
    if isinstance(value, np.generic) or (getattr(value, "ndim", None) == 0 and hasattr(value, "item")):
        return value.item()
    return value
