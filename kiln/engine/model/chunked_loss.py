"""The causal-LM loss without the whole [tokens x vocabulary] logits tensor (`train.loss.chunked`).

The plain loss multiplies every hidden state by the LM head at once: for a 128k vocabulary and 4k tokens
that is 2 GiB of fp32 logits, their gradient again, and cross-entropy's intermediates, the largest memory
item of the step. Here the tokens are cut into chunks of `chunk_size`; each chunk's logits, upcast to
fp32, and its summed cross-entropy are computed under activation checkpointing, so forward keeps only the
chunk's scalar and backward recomputes one chunk's logits at a time. The peak is one chunk's logits.

It is Transformers' `ForCausalLMLoss`, term for term: labels shifted left by one (tokens < n predict n)
unless the batch brings `shift_labels` (packed rows do), `ignore_index` tokens left out, the sum divided by
`num_items_in_batch` when the step passes it, else the mean over the counted tokens. Only the order of
the sum differs, so loss and gradients equal the plain loss's to float rounding.

Models whose logits are not `hidden @ lm_head` (a soft-cap, a logit scale) are refused by name: the
chunked loss would be silently different from theirs.

`use_chunked_loss` puts it inside the model: the Transformers causal LM's `forward` is replaced on the
instance, so whatever wraps the model (DDP, FSDP, a PeftModel) still calls its own forward, which calls this
one. A training forward (gradients on, labels given) runs the decoder and the chunked loss and returns the
loss without logits; any other call (evaluation, prediction, generation) is the model's own forward.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kiln.utils.errors import ConfigError

#: config attributes that change the logits after the LM head (Gemma 2/3, Cohere, Granite): refused
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    chunk_size: int,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """`ForCausalLMLoss(F.linear(hidden, weight, bias), labels, ...)` computed `chunk_size` tokens at a time.
    `hidden` is [..., tokens, width]; `labels` (or the already shifted `shift_labels`) [..., tokens]."""
    if chunk_size < 1:
        raise ConfigError(f"train.loss.chunk_size is {chunk_size}; it must be a positive number of tokens.")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = shift_labels.reshape(-1).to(hidden.device)
    total = flat_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat_hidden.shape[0], chunk_size):
        chunk = slice(start, start + chunk_size)
        total = total + checkpoint(
            _chunk_loss, flat_hidden[chunk], weight, bias, flat_labels[chunk], ignore_index, use_reentrant=False
        )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return total / (flat_labels != ignore_index).sum()  # the mean over counted tokens (nan if none, as F.cross_entropy)


def lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """(the decoder that returns the last hidden state, the LM head) of a Transformers causal LM, or one
    sentence saying why the chunked loss cannot stand in for this model's."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    for attr in LOGIT_TRANSFORMS:
        value = getattr(config, attr, None)
        if value not in (None, 1, 1.0):
            raise ConfigError(
                f"{name} transforms its logits after the LM head ({attr}={value}), which the chunked loss "
                "does not; unset train.loss.chunked for this model."
            )
    hf: Any = model  # HF methods, found by hasattr (nn.Module.__getattr__ would type them Tensor | Module)
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    decoder = hf.get_decoder() if hasattr(hf, "get_decoder") else None
    if type(head) is not nn.Linear or decoder is None or decoder is model:
        raise ConfigError(
            f"train.loss.chunked needs a Transformers causal LM with a plain nn.Linear LM head and a "
            f"decoder (get_decoder()); {name} has neither form, so unset train.loss.chunked."
        )
    return decoder, head


def chunked_causal_lm_loss(
    model: nn.Module, inputs: Mapping[str, Any], *, chunk_size: int, num_items_in_batch: Any = None
) -> torch.Tensor:
    """The loss `model(**inputs).loss` would return, without building the logits: the decoder's last
    hidden state through the LM head chunk by chunk."""
    decoder, head = lm_parts(model)
    inputs = dict(inputs)
    labels, shift_labels = inputs.pop("labels", None), inputs.pop("shift_labels", None)
    if labels is None and shift_labels is None:
        raise ConfigError(
            "train.loss.chunked computes the loss from the batch's labels, and this batch has none; "
            "add labels (a causal-LM collator does) or unset train.loss.chunked."
        )
    hidden = decoder(**inputs).last_hidden_state
    return chunked_cross_entropy(
        hidden,
        head.weight,
        head.bias,
        labels if labels is not None else shift_labels,
        chunk_size=chunk_size,
        num_items_in_batch=num_items_in_batch,
        shift_labels=shift_labels,
    )


def causal_lm(model: nn.Module) -> nn.Module:
    """The outermost Transformers model in `model` with an LM head (a PeftModel's base causal LM, say)."""
    for module in model.modules():
        hf: Any = module
        is_hf = any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)
        if is_hf and hasattr(hf, "get_output_embeddings") and hf.get_output_embeddings() is not None:
            return module
    raise ConfigError(
        f"train.loss.chunked needs a Transformers causal LM (a model with an LM head), and {type(model).__name__} "
        "holds none; unset train.loss.chunked."
    )


#: keyword arguments of a causal LM's forward that only shape its output (the chunked loss returns the loss)
_OUTPUT_ONLY = ("return_dict", "logits_to_keep", "num_logits_to_keep")


def use_chunked_loss(model: nn.Module, chunk_size: int) -> nn.Module:
    """Make the causal LM inside `model` compute its training loss chunk by chunk (in place); returns it."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    lm = causal_lm(model)
    lm_parts(lm)  # refuses what it cannot stand in for, before training
    inner = getattr(lm.forward, "_kiln_plain_forward", lm.forward)  # set up before: wrap the model's own

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        labelled = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
        if args or not labelled or not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        items = kwargs.pop("num_items_in_batch", None)
        inputs = {k: v for k, v in kwargs.items() if k not in _OUTPUT_ONLY}
        loss = chunked_causal_lm_loss(lm, inputs, chunk_size=chunk_size, num_items_in_batch=items)
        return CausalLMOutputWithPast(loss=loss)

    forward._kiln_plain_forward = inner  # type: ignore[attr-defined]
    lm.forward = forward
    return lm
