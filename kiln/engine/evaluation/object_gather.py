"""HF's `eval_use_gather_object`: evaluation outputs that are not tensors (decoded strings from
`preprocess_logits_for_metrics`, lists of spans, ...) or are ragged in ways padding cannot fix are
kept per rank as Python objects and gathered ONCE at the end with `all_gather_object`.

Lists are joined item by item (as accelerate's `gather_object` flattens them), arrays are
concatenated (sequence dims right-padded). kiln's eval sampler gives each rank one contiguous shard
padded at the end, so the rank-major join is dataset order and cutting it to the dataset's length
drops the padding duplicates. The cost is pickling every output, which is why it is opt-in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.engine.evaluation.nested import concat_padded, nested_numpify


class ObjectAccumulator:
    """Drop-in for EvalAccumulator's `add` / `get_arrays` (with do_concat_batches)."""

    def __init__(
        self, all_gather_object: Callable[[Any], list[Any]] | None, num_samples: int | None, padding_index: float = -100
    ) -> None:
        self.all_gather_object = all_gather_object  # None on one process
        self.num_samples = num_samples
        self.padding_index = padding_index
        self.parts: dict[str, list[Any]] = {}

    def add(self, outputs: dict[str, Any] | None) -> None:
        for key, value in (outputs or {}).items():
            self.parts.setdefault(key, []).append(nested_numpify(value))

    def get_arrays(self) -> dict[str, Any]:
        per_rank = self.all_gather_object(self.parts) if self.all_gather_object is not None else [self.parts]
        joined = {}
        for key in self.parts:
            items = [item for parts in per_rank for item in parts.get(key, [])]  # rank-major: dataset order
            value = self._join(items)
            joined[key] = value[: self.num_samples] if self.num_samples is not None else value
        return joined

    def _join(self, items: list[Any]) -> Any:
        if items and all(isinstance(i, np.ndarray) and i.ndim >= 1 for i in items):
            return concat_padded(items, self.padding_index)
        flat: list[Any] = []
        for item in items:
            flat.extend(list(item) if isinstance(item, (list, tuple, np.ndarray)) else [item])
        return flat
