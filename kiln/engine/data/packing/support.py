"""Whether a model can be trained on packed rows, decided by looking at it, and what its batches need.

Packing is exact only if each packed example sees what it would see alone. So the model must:

- be a Transformers model (kiln gives its attention the examples' boundaries through transformers'
  conventions; a TrainingModule's own attention cannot be reached), and not an encoder-decoder;
- take `position_ids` in `forward` and use them as given. Models that number positions from
  `padding_idx + 1` (RoBERTa and its relatives: learned absolute positions with an offset rule, which they
  derive from the input ids; transformers#47496) are refused: packing's positions restart at 0;
- take `**kwargs` in `forward`, which carry the boundaries to its attention (and past kiln's
  `remove_unused_columns`);
- use a flash-attention implementation (which takes the boundaries directly), or sdpa, eager or
  flex_attention with its masks built by transformers' `masking_utils`, which passes a prepared 4-D mask
  on unchanged (see kiln.engine.data.packing.attention);
- have attention layers of one kind, all causal or all bidirectional (their `is_causal`), which decides
  the mask's shape;
- for a mask kiln builds, attend over whole examples: a sliding window shorter than `max_length` (Mistral's
  4096, Gemma's sliding layers) would be lost, so it is refused.

Labels: a model whose loss shifts them (transformers' causal-LM loss) gets -100 at each example's first
token (see the collator)."""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any

from torch import nn

from kiln.utils.errors import ConfigError


@dataclass(frozen=True)
class PackingModel:
    name: str
    #: "varlen" (flash attention takes the boundaries), or the mask kiln builds: "sdpa", "eager", "flex"
    attention: str
    causal: bool
    shifts_labels: bool
    pad_id: int
    #: the sliding window a kiln-built mask would have to keep (None: none, or flash keeps it)
    window: int | None


MASK_BUILDERS = ("create_causal_mask", "create_bidirectional_mask", "create_sliding_window_causal_mask")
KINDS = {"sdpa": "sdpa", "eager": "eager", "flex_attention": "flex"}


def inspect_model(model: nn.Module, training_module: bool) -> PackingModel:
    """What packing needs to know about `model`, or a ConfigError naming what it lacks."""
    from kiln.engine.data.columns import _inspected

    if training_module:
        raise ConfigError(
            f"data.packing needs a Transformers model trained as model(**batch); {type(model).__name__} is a "
            "TrainingModule, whose attention kiln cannot give the packed examples' boundaries."
        )
    inner = _inspected(model)
    config = getattr(inner, "config", None)
    name = type(inner).__name__
    if not hasattr(config, "_attn_implementation"):
        raise ConfigError(
            f"data.packing needs a Transformers model (a PreTrainedModel with a config), whose attention kiln "
            f"can give the packed examples' boundaries; {name} is not one."
        )
    model_type = getattr(config, "model_type", "") or name
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(
            f"{name} is an encoder-decoder model; data.packing packs the inputs of decoder-only and "
            "encoder-only models."
        )
    params = inspect.signature(inner.forward).parameters
    if "position_ids" not in params:
        raise ConfigError(
            f"{name}.forward takes no position_ids, so the positions of packed examples cannot restart at "
            "0; train it without data.packing."
        )
    if any(callable(getattr(m, "create_position_ids_from_input_ids", None)) for m in inner.modules()):
        raise ConfigError(
            f"{model_type} ({name}) numbers its positions from padding_idx + 1 (learned absolute positions "
            "with an offset rule), which packed position_ids restarting at 0 would shift; train it without "
            "data.packing."
        )
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise ConfigError(
            f"{name}.forward takes no **kwargs, through which data.packing hands its attention the packed "
            "examples' boundaries; train it without data.packing."
        )
    kind = _attention_kind(config, inner, name)
    return PackingModel(
        name=name,
        attention=kind,
        causal=_causal(inner, config, name),
        shifts_labels=_shifts_labels(inner, config),
        pad_id=_pad_id(config),
        window=None if kind == "varlen" else _window(config),
    )


def _shifts_labels(inner: nn.Module, config: Any) -> bool:
    """Whether the model's loss scores logits at t against labels[t + 1]. Not kiln's item-counting rule
    (`loss_shifts_labels`, HF's): a model without a known `loss_type` (GPT-2's LMHeadModel) counts as not
    shifting there, but its `loss_function` falls back to the causal-LM loss, which shifts."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    loss_type: Any = getattr(inner, "loss_type", None)  # a str on Transformers models (LOSS_MAPPING's keys)
    return LOSS_MAPPING.get(loss_type, ForCausalLMLoss) is ForCausalLMLoss and not getattr(
        config, "is_encoder_decoder", False
    )


def _attention_kind(config: Any, inner: nn.Module, name: str) -> str:
    from transformers.utils.generic import is_flash_attention_requested

    impl = config._attn_implementation
    if is_flash_attention_requested(config):
        return "varlen"
    if impl not in KINDS:
        raise ConfigError(
            f"{name} uses the attention implementation {impl!r}; data.packing supports sdpa, eager, "
            "flex_attention and the flash-attention ones."
        )
    from transformers import masking_utils

    # the model's own class: FSDP2 swaps in a subclass of it made in torch (`FSDPLlamaForCausalLM`)
    own = next(cls for cls in type(inner).__mro__ if not cls.__module__.startswith("torch."))
    module = sys.modules.get(own.__module__)
    if not any(getattr(module, f, None) is getattr(masking_utils, f) for f in MASK_BUILDERS):
        raise ConfigError(
            f"{name} does not build its attention mask with transformers' masking_utils, so it may not "
            f"apply the per-example mask data.packing gives it with {impl}; use a flash-attention "
            "implementation or train it without data.packing."
        )
    return KINDS[impl]


def _causal(inner: nn.Module, config: Any, name: str) -> bool:
    kinds = {flag for flag in (getattr(m, "is_causal", None) for m in inner.modules()) if isinstance(flag, bool)}
    declared = getattr(config, "is_causal", None)
    if len(kinds) != 1 or (isinstance(declared, bool) and {declared} != kinds):
        raise ConfigError(
            f"{name} has {'no attention layers kiln recognises' if not kinds else 'both causal and bidirectional attention'}"
            "; data.packing builds one per-example mask and needs attention layers of one kind."
        )
    return kinds.pop()


def _window(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    sliding = getattr(text, "sliding_window", None)
    if layer_types is not None:
        uses = "sliding_attention" in layer_types
    else:
        uses = getattr(text, "use_sliding_window", True) is not False
    windows = [
        w
        for w in (sliding if uses else None, getattr(text, "attention_chunk_size", None))
        if isinstance(w, int) and w > 0
    ]
    return min(windows) if windows else None


def _pad_id(config: Any) -> int:
    pad = getattr(config, "pad_token_id", None)
    vocab = getattr(config, "vocab_size", None)
    return pad if isinstance(pad, int) and pad >= 0 and (not isinstance(vocab, int) or pad < vocab) else 0


def check_window(model: PackingModel, max_length: int) -> None:
    if model.window is not None and max_length > model.window:
        raise ConfigError(
            f"{model.name} attends within a sliding window of {model.window} tokens, shorter than "
            f"data.packing.max_length={max_length}, and the per-example mask kiln builds for "
            f"{model.attention} would not keep it; set max_length to at most {model.window} or use a "
            "flash-attention implementation."
        )
