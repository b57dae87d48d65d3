"""The default collator: torch's `default_collate` with HF's `default_data_collator` rules for dict items, and a
direct stack for the usual batch (dicts of plain tensors)."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import default_collate


def default_data_collator(features: list[Any]) -> Any:
    """torch's default_collate, plus two rules of HF's default_data_collator for dict items: a
    `label`/`label_ids` key becomes `labels`, and a value that is a Python list (a `datasets` row without
    a format: `input_ids` as a list of ints) becomes one tensor `torch.tensor([...])` of shape
    [batch, ...] (default_collate would transpose it into a list of per-position tensors).

    The usual batch, dicts of plain tensors collated in the main process, is stacked directly: the same
    tensors default_collate returns (it stacks them too), without its per-key dispatch (~20 Python calls a
    batch, as much as the rest of the loader's per-batch work; see `_stacked`)."""
    first = features[0] if features else None
    try:  # free until something raises: rows of unequal length get a sentence instead of torch.stack's error
        # like HF, the first feature decides (copying every feature's dict costs ~1 us each per batch)
        if not isinstance(first, Mapping):
            return default_collate(features)
        if "labels" not in first and (first.get("label") is not None or first.get("label_ids") is not None):
            key = "label" if first.get("label") is not None else "label_ids"
            rest = [{k: v for k, v in f.items() if k not in ("label", "label_ids")} for f in features]
            return {
                "labels": _hf_labels([f[key] for f in features]),
                **(default_data_collator(rest) if rest[0] else {}),
            }
        if type(first) is dict and _stackable(first.values()) and get_worker_info() is None:
            return _stacked(first, features)
        if any(map(isinstance, first.values(), itertools.repeat(list))):
            return {
                k: _list_tensor([f[k] for f in features])
                if isinstance(v, list)
                else default_collate([f[k] for f in features])
                for k, v in first.items()
            }
        return default_collate(features)
    except (RuntimeError, ValueError):
        from kiln.engine.data.unequal_rows import unequal_rows

        unequal = unequal_rows(features)
        if unequal is None:
            raise
        raise unequal from None


def _hf_labels(values: list[Any]) -> torch.Tensor:
    """HF's labels tensor from `label` / `label_ids` values: tensors stacked; Python numbers as int64 when
    the first is an int, else float32 (default_collate would make Python floats float64, which would promote
    a float32 regression head's loss and its backward to float64)."""
    first = values[0]
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return torch.stack(values)
    sample = first.item() if isinstance(first, torch.Tensor) else first
    while isinstance(sample, (list, tuple)) and sample:
        sample = sample[0]
    return torch.tensor(values, dtype=torch.long if isinstance(sample, int) else torch.float)


_PLAIN = {torch.Tensor}
_STRIDED = {torch.strided}
_LAYOUT, _NESTED = operator.attrgetter("layout"), operator.attrgetter("is_nested")


def _stackable(values: Any) -> bool:
    """Whether default_collate would stack every value of this (first) item: plain dense tensors only, checked
    without a Python call per value. Nested and sparse tensors, which it refuses, and tensor subclasses,
    which it may collate by their own rules, take its path."""
    return {*map(type, values)} == _PLAIN and {*map(_LAYOUT, values)} == _STRIDED and not any(map(_NESTED, values))


def _stacked(first: dict[str, Any], features: list[Any]) -> dict[str, Any]:
    """default_collate's result for dicts of tensors (a dict in the first item's key order; a missing key
    or an item that is not a tensor raises as it would there). Only in the main process: in a worker it
    stacks into shared memory, which saves the copy to the main process."""
    return {k: torch.stack(list(map(operator.itemgetter(k), features))) for k in first}


def _list_tensor(values: list[Any]) -> Any:
    try:
        return torch.tensor(values)
    except (TypeError, ValueError, RuntimeError):  # ragged or not numbers: torch's rule (and its error) applies
        return default_collate(values)
