"""NEFTune (HF's `neftune_noise_alpha`, Jain et al. 2023): uniform noise on the input embeddings
while training, which helps instruction fine-tuning. The noise comes from a forward hook that
exists only during fit(), so evaluation, prediction and the saved model never see it."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kiln.utils.errors import KilnError


def input_embeddings(model: nn.Module) -> nn.Module:
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if not isinstance(emb, nn.Module):
        raise KilnError(
            f"neftune_noise_alpha needs the input embeddings of {type(model).__name__}: Transformers models "
            "have get_input_embeddings(); give your model one that returns its nn.Embedding."
        )
    return emb


def _add_noise(module: nn.Module, args: Any, output: torch.Tensor, alpha: float) -> torch.Tensor:
    if not module.training:
        return output
    if output.dim() != 3:
        raise KilnError(
            f"neftune_noise_alpha expects embeddings shaped (batch, sequence, hidden), got {tuple(output.shape)}."
        )
    magnitude = alpha / math.sqrt(output.size(1) * output.size(2))
    return output + torch.zeros_like(output).uniform_(-magnitude, magnitude)


@contextlib.contextmanager
def neftune(model: nn.Module, alpha: float | None) -> Iterator[None]:
    """Noisy input embeddings inside the block (nothing when alpha is None)."""
    if alpha is None:
        yield
        return
    handle = input_embeddings(model).register_forward_hook(functools.partial(_add_noise, alpha=float(alpha)))
    try:
        yield
    finally:
        handle.remove()
