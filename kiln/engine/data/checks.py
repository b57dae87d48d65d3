"""A look at the first training item before any model is placed or process group used: items that
the collator or the model cannot take (tuples where mappings are expected) fail with one sentence
saying what the dataset returned and what is needed, instead of a traceback from a worker."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch

from kiln.utils.errors import KilnError


def describe(item: Any) -> str:
    """`tuple (tensor[8], tensor[])` style: the type and what it holds, without values."""
    def one(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"tensor{list(x.shape)}"
        return type(x).__name__

    if isinstance(item, (tuple, list)):
        inner = ", ".join(one(x) for x in item[:4]) + (", ..." if len(item) > 4 else "")
        return f"{type(item).__name__} ({inner})"
    return one(item)


def _first_item(dataset: Any) -> Any:
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        return None
    try:
        if len(dataset) == 0:
            return None
        return dataset[0]
    except Exception:  # noqa: BLE001 - datasets that cannot be indexed are left to the dataloader
        return None


def _collate_quietly(collator: Callable[[list[Any]], Any], item: Any) -> Any:
    """Collate one item without consuming random numbers (masking collators draw them), so the
    probe leaves the run's random streams exactly as they were."""
    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            return collator([item])
    finally:
        random.setstate(py)
        np.random.set_state(npy)


def check_first_item(dataset: Any, collator: Optional[Callable[[list[Any]], Any]], training_module: bool) -> None:
    """Raise KilnError if the dataset's items (tuples/lists) cannot become what the model needs."""
    item = _first_item(dataset)
    if item is None or isinstance(item, Mapping) or not isinstance(item, Sequence) or isinstance(item, (str, bytes)):
        return
    if collator is None and training_module:
        return  # default_collate keeps the tuple; training_step decides what it accepts
    from kiln.engine.data.loaders import default_data_collator

    name = type(collator).__name__ if collator is not None else "the default collator"
    try:
        batch = _collate_quietly(collator or default_data_collator, item)
    except Exception as err:  # noqa: BLE001 - the collator's own error type is unknown
        raise KilnError(
            f"The data collator ({name}) failed on the dataset's items, which are {describe(item)} ({type(err).__name__}: "
            f"{err}): it expects mappings such as {{'input_ids': ..., 'labels': ...}}; return dicts from the dataset's "
            "__getitem__, or pass a data_collator that accepts tuples.") from None
    if not training_module and not isinstance(batch, Mapping):
        raise KilnError(
            f"The dataset's items are {describe(item)}, which {name} turns into a {type(batch).__name__}, but an "
            "HF-contract model is called as model(**batch) and needs a dict: return dicts such as {'input_ids': ..., "
            "'labels': ...} from __getitem__, pass a data_collator that builds one, or wrap the model in a "
            "TrainingModule whose training_step(batch) takes the tuple.")
