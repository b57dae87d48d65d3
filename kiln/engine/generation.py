"""Seq2Seq's `predict_with_generate`: predictions are `model.generate(...)` token ids."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kiln.engine.trainer import Trainer


def generate_predictions(trainer: "Trainer", inputs: dict[str, Any]) -> torch.Tensor:
    e = trainer.config.eval
    kwargs: dict[str, Any] = dict(e.generation_kwargs or {})
    if e.generation_max_length is not None:
        kwargs.setdefault("max_length", e.generation_max_length)
    if e.generation_num_beams is not None:
        kwargs.setdefault("num_beams", e.generation_num_beams)
    gen_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "decoder_input_ids", "decoder_attention_mask")}
    return trainer.model.generate(**gen_inputs, **kwargs)
