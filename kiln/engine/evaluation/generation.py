"""Seq2Seq's `predict_with_generate`: predictions are the token ids `model.generate(...)` returns.

Which generate() arguments win, most specific first (HF's Seq2SeqTrainer order):
`evaluate(..., **gen_kwargs)` / `predict(..., **gen_kwargs)` > `eval.generation_max_length` /
`eval.generation_num_beams` > `eval.generation_kwargs` > the model's own `generation_config`.
Sequences of different lengths across batches are right-padded with `eval.padding_index` (-100) by
the evaluation loop, like every other prediction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from torch import nn

_LENGTH_KEYS = ("max_length", "max_new_tokens")
# inputs that describe the target side: generate() builds the decoder inputs itself
_TARGET_KEYS = ("decoder_input_ids", "decoder_attention_mask", "decoder_inputs_embeds")


def generation_kwargs(eval_config: Any, call_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments for `generate()`, merged in the precedence the module docstring gives."""
    kwargs: dict[str, Any] = dict(eval_config.generation_kwargs or {})
    if eval_config.generation_max_length is not None:
        kwargs.pop("max_new_tokens", None)  # the named setting wins over a length inside generation_kwargs
        kwargs["max_length"] = eval_config.generation_max_length
    if eval_config.generation_num_beams is not None:
        kwargs["num_beams"] = eval_config.generation_num_beams
    if any(call_kwargs.get(k) is not None for k in _LENGTH_KEYS):
        for key in _LENGTH_KEYS:  # one length limit: the one the caller gave
            kwargs.pop(key, None)
    kwargs.update({k: v for k, v in call_kwargs.items() if v is not None})
    return kwargs


def generate_predictions(
    model: nn.Module, inputs: Mapping[str, Any], skip: set[str], eval_config: Any, call_kwargs: Mapping[str, Any]
) -> torch.Tensor:
    """Generated token ids `[batch, length]` for one batch. `inputs` are the forward's inputs; the
    label keys in `skip` and the decoder inputs are left out (generate builds the decoder side)."""
    generate = getattr(model, "generate", None)
    if generate is None:
        raise KilnError(
            f"eval.predict_with_generate is set but {type(model).__name__} has no generate() method; "
            "use a Transformers generation model or set predict_with_generate=false."
        )
    if not isinstance(inputs, Mapping):
        raise TypeError("predict_with_generate needs dict batches (model.generate(**batch)).")
    gen_inputs = {k: v for k, v in inputs.items() if k not in skip and k not in _TARGET_KEYS}
    return generate(**gen_inputs, **generation_kwargs(eval_config, call_kwargs))
