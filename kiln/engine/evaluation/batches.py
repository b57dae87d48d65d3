"""Helpers of the evaluation loop: walking a loader with a look-ahead (to know the last batch), the
sampler behind a device-feeding loader and the accumulator's arrays by key."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from kiln.utils.errors import KilnError


def collected(arrays: Any) -> dict[str, Any]:
    """The accumulator's result by key. With do_concat_batches=False each value is a list with one
    entry per batch, except the losses, which are joined for the mean."""
    if not arrays:
        return {}
    if isinstance(arrays, Mapping):
        return dict(arrays)
    out: dict[str, Any] = {key: [batch[key] for batch in arrays] for key in arrays[0]}
    if "losses" in out:
        out["losses"] = np.concatenate(out["losses"])
    return out


def sampler_of(loader: Any) -> Any:
    """The sampler of a DataLoader, also through a device-feeding wrapper (XLA's `_loader`)."""
    sampler = getattr(loader, "sampler", None)
    return sampler if sampler is not None else getattr(getattr(loader, "_loader", None), "sampler", None)


def with_last(iterable: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """(item, is_last) pairs, looking one item ahead: works for loaders without a length."""
    it = iter(iterable)
    try:
        current = next(it)
    except StopIteration:
        return
    for item in it:
        yield current, False
        current = item
    yield current, True


def inputs_for_metrics(model: Any, batch: Any) -> Any:
    """The model's main input (`model.main_input_name`, default "input_ids") for EvalPrediction.inputs."""
    name = getattr(model, "main_input_name", "input_ids")
    if isinstance(batch, Mapping):
        if name not in batch:
            raise KilnError(
                f"include_inputs_for_metrics: the batch has no {name!r} (keys: {', '.join(map(str, batch))}); "
                "set `main_input_name` on the model to the key that holds its inputs."
            )
        return batch[name]
    if isinstance(batch, (list, tuple)) and batch:
        return batch[0]
    return batch
