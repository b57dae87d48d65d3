"""HF's `label_smoothing_factor` for models that return logits (classification and causal LM)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def smoothed_loss(model: nn.Module, outputs: Any, labels: torch.Tensor, factor: float, ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy with label smoothing `factor`; causal LMs compare token t's logits with label t+1."""
    logits = outputs["logits"] if isinstance(outputs, dict) or hasattr(outputs, "keys") else outputs[0]
    if type(model).__name__.endswith("ForCausalLM"):
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                           ignore_index=ignore_index, label_smoothing=factor)
