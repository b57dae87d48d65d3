"""The sentence for a batch whose rows differ in length under kiln's default collator, which stacks
rows as they are (as HF's default_data_collator does): torch's own error ("stack expects each tensor
to be equal size", "each element in list of batch should be of equal size") names neither the key nor
the remedy. Built only after the collator failed, so it costs the batches that collate nothing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kiln.utils.errors import KilnError


def _shape(value: Any) -> tuple[int, ...] | None:
    """The shape stacking would see: a tensor's or array's, a list's nested lengths; None for scalars
    and other values (which stack whatever their value)."""
    if isinstance(value, torch.Tensor) or (hasattr(value, "shape") and hasattr(value, "dtype")):
        return tuple(value.shape)
    if isinstance(value, (list, tuple)):
        return (len(value), *(_shape(value[0]) or ())) if value else (0,)
    return None


def _fields(item: Any) -> list[tuple[str, Any]]:
    """(name, how to read it from an item): a mapping's keys, a tuple's positions, or the item itself."""
    if isinstance(item, Mapping):
        return [(repr(key), key) for key in item]
    if isinstance(item, Sequence) and not isinstance(item, (str, bytes)) and item and _shape(item[0]) is not None:
        return [(f"position {i} of the items", i) for i in range(len(item))]
    return [("the items", None)]


def unequal_rows(features: list[Any]) -> KilnError | None:
    """The error naming the first field whose rows differ in shape, with the shapes; None when every
    field's rows have one shape (the collator failed for another reason, which is left as it is)."""
    if not features:
        return None
    for name, key in _fields(features[0]):
        try:
            shapes = [_shape(row if key is None else row[key]) for row in features]
        except (KeyError, IndexError, TypeError):  # rows that lack the field fail on their own terms
            continue
        seen = sorted({s for s in shapes if s is not None})
        if len(seen) < 2:
            continue
        flat = all(len(s) == 1 for s in seen)
        shown = [str(s[0]) if flat else str(list(s)) for s in seen[:3]]
        listed = f"{', '.join(shown[:-1])} and {shown[-1]}" + (", ..." if len(seen) > 3 else "")
        return KilnError(
            f"The rows of a batch have different {'lengths' if flat else 'shapes'} under {name} ({listed}), and kiln's "
            "default collator stacks rows as they are: pad them to one length when preparing the data (e.g. the "
            "tokenizer's padding='max_length'), or pass a data_collator that pads each batch (e.g. transformers' "
            "DataCollatorWithPadding)."
        )
    return None
