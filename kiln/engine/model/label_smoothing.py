"""HF's `label_smoothing_factor` for models that return logits (classification and causal LM)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def label_smoothing_factor(model: nn.Module, factor: float) -> float:
    """The smoothing the run uses: `factor`, or 0 with HF's warning for a multi-label classifier, whose
    own loss (binary cross-entropy on float targets) has no class to smooth towards."""
    if factor and getattr(getattr(model, "config", None), "problem_type", None) == "multi_label_classification":
        warnings.warn(
            "Label smoothing is not compatible with multi-label classification. "
            "Disabling label smoothing for this training run.",
            UserWarning,
            stacklevel=3,
        )
        return 0.0
    return float(factor)


def smoothed_loss(
    model: nn.Module,
    outputs: Any,
    labels: torch.Tensor,
    factor: float,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Cross-entropy with label smoothing `factor`; causal LMs compare token t's logits with label t+1.

    The mean is over this micro-batch's labelled items, or, like HF's LabelSmoother, the sum divided by
    `num_items_in_batch` (the whole window's items) when the Trainer passes it."""
    if labels.is_floating_point():
        raise ValueError(
            "label_smoothing_factor needs class-index labels, but the labels are floats (multi-label or "
            "regression targets): set the model's config.problem_type, or label_smoothing_factor=0."
        )
    logits = outputs["logits"] if isinstance(outputs, dict) or hasattr(outputs, "keys") else outputs[0]
    if _is_causal_lm(model):
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    flat_logits, flat_labels = logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1)
    if num_items_in_batch is None:
        return F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index, label_smoothing=factor)
    total = F.cross_entropy(
        flat_logits, flat_labels, ignore_index=ignore_index, label_smoothing=factor, reduction="sum"
    )
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _is_causal_lm(model: nn.Module) -> bool:
    """HF's test: a causal-LM class of Transformers' auto mapping (GPT2LMHeadModel too), or a *ForCausalLM;
    for a PeftModel, the class of the model inside it."""
    from kiln.engine.model.peft import base_model_of

    name = type(base_model_of(model)).__name__
    if name.endswith("ForCausalLM"):
        return True
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
