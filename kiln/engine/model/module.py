"""What kiln trains: a Lightning-style `TrainingModule`, or any `nn.Module` that follows the Hugging
Face contract (`model(**batch)` returns a ModelOutput / dict / tuple whose `.loss` or first element
is the loss). Helpers here turn either kind's outputs into (loss, predictions, labels)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard

import torch
from torch import nn

from kiln.utils.tensors import batch_size_of

StepOutput = torch.Tensor | Mapping[str, Any]


class TrainingModule(nn.Module):
    """Subclass this and implement `training_step`; everything else has a sensible default.

    `training_step(batch)` returns the loss averaged over the items it covers (a tensor), or a dict
    with "loss". kiln weights each micro-batch by `num_items(batch)` so that gradient accumulation
    gives exactly the gradient of the whole window's mean loss (HF's `num_items_in_batch`).
    """

    def training_step(self, batch: Any) -> StepOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch).")

    def validation_step(self, batch: Any) -> StepOutput:
        """Return a dict with "loss" and optionally "logits"/"predictions" and "labels".

        "loss" is the batch's mean loss (a scalar: it counts once per sample of the batch, HF's rule, so
        a short last batch weighs less) or one loss per sample (averaged as they are); `eval_loss` is
        the mean over all samples either way."""
        out = self.training_step(batch)
        return out if isinstance(out, Mapping) else {"loss": out}

    def predict_step(self, batch: Any) -> StepOutput:
        return self.validation_step(batch)

    def configure_optimizers(self) -> Any:
        """Return None (use the config's optimizer), an optimizer, or (optimizer, scheduler)."""
        return None

    def num_items(self, batch: Any) -> int | torch.Tensor:
        """Items the loss of `batch` averages over (tokens with a label, or samples)."""
        return count_items(batch)


def count_items(batch: Any, label_names: Sequence[str] | None = None, ignore_index: int = -100) -> int | torch.Tensor:
    """Labelled items in a batch: non-ignored label entries if the batch has labels, else samples."""
    if isinstance(batch, Mapping):
        for name in label_names or ("labels",):
            labels = batch.get(name)
            if isinstance(labels, torch.Tensor) and labels.is_floating_point() is False:
                return labels.ne(ignore_index).sum()
    return batch_size_of(batch)


def is_training_module(model: nn.Module) -> TypeGuard[TrainingModule]:
    return isinstance(model, TrainingModule)


def loss_from_output(output: Any) -> torch.Tensor:
    """The loss inside a step or model output (tensor, dict/ModelOutput with "loss", or tuple)."""
    if type(output) is dict:  # the usual case, checked without the general path's isinstance calls
        loss = output.get("loss")
        if type(loss) is torch.Tensor and not loss.dim():
            return loss
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


def model_accepts_loss_kwargs(model: nn.Module) -> bool:
    """Whether the model divides its loss by `num_items_in_batch` itself, by HF's rule: the model's own
    `accepts_loss_kwargs` attribute when it has one, else whether `forward` takes `num_items_in_batch`
    or `**kwargs` (every Transformers 5 model). kiln then passes the window's item count to the model
    and does not weight the loss again. Set `model.accepts_loss_kwargs = False` on a model whose loss
    ignores the count (as in HF)."""
    declared = getattr(model, "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    return accepts_kwarg(model, "num_items_in_batch")


def loss_shifts_labels(model: nn.Module) -> bool:
    """HF's rule for counting items: a decoder-only Transformers model whose `loss_type` maps to the
    causal-LM loss predicts label t+1 from token t, so position 0 of each row is never a target."""
    loss_type = getattr(model, "loss_type", None)
    if loss_type is None:
        return False
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return False
    encoder_decoder = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    return LOSS_MAPPING.get(loss_type) is ForCausalLMLoss and not encoder_decoder


def item_counter(model: nn.Module, label_names: Sequence[str]) -> Callable[[Any], int | torch.Tensor]:
    """Items in one micro-batch of an HF-contract model, counted as HF counts `num_items_in_batch`:
    a batch's `shift_labels` if it has them, else the labels (without position 0 for causal LMs)."""
    shifts = loss_shifts_labels(model)

    def count(batch: Any) -> int | torch.Tensor:
        if isinstance(batch, Mapping):
            shifted = batch.get("shift_labels")
            if isinstance(shifted, torch.Tensor):
                return shifted.ne(-100).sum()
            labels = batch.get("labels")
            if shifts and isinstance(labels, torch.Tensor) and not labels.is_floating_point():
                return labels[..., 1:].ne(-100).sum()
        return count_items(batch, label_names)

    return count


def forward_argument_names(model: nn.Module) -> set[str] | None:
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
