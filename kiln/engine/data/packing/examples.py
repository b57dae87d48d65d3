"""One training example as packing reads it: a dict whose values hold one entry per token.

Packing concatenates examples token by token, so every key it keeps must hold a sequence as long as
`input_ids` (`labels`, `token_type_ids`, ...). `attention_mask` is dropped when it is all ones (the
packed batch's attention comes from the example boundaries); zeros mean padding inside the example,
which is refused, as are `position_ids` (packing numbers the positions) and per-example values such as a
classification label. Keys the model's forward does not take are dropped first when
`remove_unused_columns` asks for it (`keep`), as the collator would have dropped them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kiln.utils.errors import ConfigError

#: per-token keys packing writes itself
OWN_KEYS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_lengths")


class ExampleReader:
    def __init__(self, keep: frozenset[str] | None = None) -> None:
        self.keep = keep

    def __call__(self, example: Any, where: str) -> dict[str, torch.Tensor]:
        """The example's per-token tensors (1-D, equal lengths); `where` names it in errors ("example 3")."""
        if not isinstance(example, Mapping) or "input_ids" not in example:
            raise ConfigError(
                f"data.packing concatenates the examples' input_ids, but {where} is a "
                f"{type(example).__name__} without input_ids; "
                "return dicts with input_ids (and labels) from the dataset."
            )
        ids = _tokens(example["input_ids"], "input_ids", where)
        out = {"input_ids": ids}
        for key, value in example.items():
            if key == "input_ids" or (self.keep is not None and key not in self.keep):
                continue
            if key in OWN_KEYS:
                raise ConfigError(
                    f"{where} has {key!r}, which data.packing computes itself for the packed rows; "
                    "remove it from the dataset."
                )
            column = _tokens(value, key, where, len(ids))
            if key == "attention_mask":
                if not bool(column.bool().all()):
                    raise ConfigError(
                        f"{where} is padded (its attention_mask has zeros); data.packing needs examples "
                        "without padding: tokenize without padding='max_length' / 'longest'."
                    )
                continue
            out[key] = column
        return out


def _tokens(value: Any, key: str, where: str, length: int | None = None) -> torch.Tensor:
    """`value` as a 1-D tensor of `length` entries, or one sentence saying why it cannot be packed."""
    try:
        tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        tensor = None
    if tensor is None or tensor.dim() != 1 or (length is not None and len(tensor) != length):
        shape = "a value" if tensor is None else f"shape {tuple(tensor.shape)}"
        need = "one entry per token" if length is None else f"one entry per token ({length}, as input_ids)"
        raise ConfigError(
            f"data.packing concatenates examples token by token, but {key!r} of {where} has {shape}, not "
            f"{need}; packing needs token-level data (a per-example label cannot be packed)."
        )
    return tensor
