"""Where a resumed run picks its data up: an iterator over the train loader that starts `skip`
batches into the epoch, by the cheapest exact route, and the iterable-dataset position a checkpoint
keeps (for datasets that can save and restore their own position)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from kiln.utils.errors import CheckpointError

log = logging.getLogger(__name__)


def stateful_dataset(loader: Iterable[Any]) -> Any:
    """The loader's iterable dataset when it can save and restore its own position, else None.

    Only with `dataloader_num_workers=0`: worker processes prefetch, so the main process's copy of
    the dataset would not know how far the loop really got."""
    from torch.utils.data import IterableDataset

    dataset = getattr(loader, "dataset", None)
    if not isinstance(dataset, IterableDataset) or int(getattr(loader, "num_workers", 0) or 0):
        return None
    if callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None)):
        return dataset
    return None


def dataset_state(loader: Iterable[Any]) -> dict[str, Any] | None:
    """The position of the loader's stateful iterable dataset, for this rank's loop state in a checkpoint; None
    when it has none to save (see `stateful_dataset`)."""
    dataset = stateful_dataset(loader)
    if dataset is None:
        return None
    state = dataset.state_dict()
    if not _plain(state):
        raise CheckpointError(
            f"{type(dataset).__name__}.state_dict() returned objects other than tensors, numbers, strings and "
            "containers of them; kiln only saves state it can load back without unpickling code."
        )
    return state


def _plain(value: Any) -> bool:
    """Whether `value` survives `torch.load(weights_only=True)` (tensors, numbers, str, containers)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    return False


def resume_iterator(
    loader: Iterable[Any], skip: int, saved_dataset: dict[str, Any] | None, *, main: bool, progress: bool
) -> Iterator[Any]:
    """An iterator over `loader` starting `skip` batches into the epoch: kiln's sampler jumps to the
    batch; an iterable dataset with `state_dict()` restores its saved position (`saved_dataset`);
    anything else is iterated past, with a note (and a progress bar on the main process). It ends
    where the epoch ends (loaders.epoch_iterator: a loader from an overridden get_train_dataloader
    gives len(loader) batches, as HF reads it)."""
    from kiln.engine.data.loaders import epoch_iterator, skip_batches
    from kiln.engine.data.samplers import ResumableSampler

    if skip == 0:
        return epoch_iterator(loader, iter(loader), 0)
    dataset = stateful_dataset(loader)
    if dataset is not None and saved_dataset is not None:
        dataset.load_state_dict(saved_dataset)
        return epoch_iterator(loader, iter(loader), skip)
    if isinstance(getattr(loader, "sampler", None), ResumableSampler) and getattr(loader, "batch_size", None):
        return skip_batches(loader, skip)[0]
    return epoch_iterator(loader, _iterate_past(loader, skip, main=main, progress=progress), skip)


def _iterate_past(loader: Iterable[Any], skip: int, *, main: bool, progress: bool) -> Iterator[Any]:
    if main:
        dataset = getattr(loader, "dataset", None)
        if stateful_dataset(loader) is not None:  # the checkpoint was saved where the dataset's state was not
            why = "the checkpoint holds no position of the dataset (saved with dataloader_num_workers > 0?)"
        elif callable(getattr(dataset, "state_dict", None)):
            why = "its state_dict() is not used with dataloader_num_workers > 0"
        else:
            why = "the dataset has no state_dict()"
        log.warning(
            "Resuming: skipping the first %d batches of the epoch by iterating over them (%s; set "
            "ignore_data_skip=true to start the epoch over instead).",
            skip,
            why,
        )
    it = iter(loader)
    bar = None
    if main and progress and skip >= 1000:
        from tqdm.auto import tqdm

        bar = tqdm(total=skip, desc="skipping batches", unit="batch")
    for i in range(skip):
        next(it, None)
        if bar is not None and (i + 1) % 100 == 0:
            bar.update(100)
    if bar is not None:
        bar.update(skip - bar.n)
        bar.close()
    return it
