"""What kiln trains: a Lightning-style `TrainingModule`, or any `nn.Module` that follows the Hugging
Face contract (`model(**batch)` returns a ModelOutput / dict / tuple whose `.loss` or first element
is the loss). Helpers here turn either kind's outputs into (loss, predictions, labels)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from kiln.utils.tensors import batch_size_of

StepOutput = Union[torch.Tensor, Mapping[str, Any]]


class TrainingModule(nn.Module):
    """Subclass this and implement `training_step`; everything else has a sensible default.

    `training_step(batch)` returns the loss averaged over the items it covers (a tensor), or a dict
    with "loss". kiln weights each micro-batch by `num_items(batch)` so that gradient accumulation
    gives exactly the gradient of the whole window's mean loss (HF's `num_items_in_batch`).
    """

    def training_step(self, batch: Any) -> StepOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch).")

    def validation_step(self, batch: Any) -> StepOutput:
        """Return a dict with "loss" and optionally "logits"/"predictions" and "labels"."""
        out = self.training_step(batch)
        return out if isinstance(out, Mapping) else {"loss": out}

    def predict_step(self, batch: Any) -> StepOutput:
        return self.validation_step(batch)

    def configure_optimizers(self) -> Any:
        """Return None (use the config's optimizer), an optimizer, or (optimizer, scheduler)."""
        return None

    def num_items(self, batch: Any) -> Union[int, torch.Tensor]:
        """Items the loss of `batch` averages over (tokens with a label, or samples)."""
        return count_items(batch)


def count_items(batch: Any, label_names: Optional[Sequence[str]] = None, ignore_index: int = -100) -> Union[int, torch.Tensor]:
    """Labelled items in a batch: non-ignored label entries if the batch has labels, else samples."""
    if isinstance(batch, Mapping):
        for name in label_names or ("labels",):
            labels = batch.get(name)
            if isinstance(labels, torch.Tensor) and labels.is_floating_point() is False:
                return labels.ne(ignore_index).sum()
    return batch_size_of(batch)


def is_training_module(model: nn.Module) -> bool:
    return isinstance(model, TrainingModule)


def loss_from_output(output: Any) -> torch.Tensor:
    """The loss inside a step or model output (tensor, dict/ModelOutput with "loss", or tuple)."""
    if isinstance(output, torch.Tensor):
        return _scalar(output, "The model returned a bare tensor")
    if isinstance(output, Mapping):
        if "loss" not in output or output["loss"] is None:
            keys = ", ".join(map(str, output.keys()))
            raise ValueError(
                f"The model output has no 'loss' (keys: {keys}). Pass labels in the batch so the model computes "
                "its loss, return {'loss': ...} from training_step, or override Trainer.compute_loss."
            )
        return _scalar(output["loss"], "The model output's 'loss'")
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return _scalar(output[0], "The first element of the model's output tuple (taken as the loss)")
    raise TypeError(
        f"Cannot find a loss in a model output of type {type(output).__name__}: return a tensor, a dict with "
        "'loss', or a tuple whose first element is the loss."
    )


def _scalar(loss: Any, what: str) -> torch.Tensor:
    """The loss must be one number (a mean over the batch); logits or per-item losses would be
    back-propagated as if summed, or fail deep inside autograd."""
    if isinstance(loss, torch.Tensor) and loss.numel() != 1:
        raise ValueError(
            f"{what} has shape {tuple(loss.shape)}, not a single loss value: training_step (or an HF-contract model's "
            "forward) must return the batch's mean loss as a 0-dim tensor, a dict with 'loss', or a tuple whose first "
            "element is the loss (reduce per-item losses with .mean())."
        )
    return loss


def accepts_kwarg(model: nn.Module, name: str) -> bool:
    """Whether `model.forward` takes `name` (or **kwargs), e.g. HF's num_items_in_batch."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def forward_argument_names(model: nn.Module) -> Optional[set[str]]:
    """Names `model.forward` accepts, or None if it takes **kwargs (anything goes)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)


def default_label_names(model: nn.Module) -> list[str]:
    """HF's rule: forward arguments whose name contains 'label' (plus QA start/end positions)."""
    names = forward_argument_names(model) or set()
    found = sorted(n for n in names if "label" in n)
    if type(model).__name__.endswith("ForQuestionAnswering"):
        found += ["start_positions", "end_positions"]
    return found or ["labels"]
