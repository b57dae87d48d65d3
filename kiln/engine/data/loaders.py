"""Dataloaders: seeded, resumable loading (`build_dataloader`), and what the fit loop asks of a loader each epoch
(`set_epoch`, `skip_batches`, where an epoch ends, its length). The sampler is in samplers.py, the default
collator in collator.py.

Resuming mid-epoch never re-iterates data: the sampler's order depends only on (seed, epoch), so a
resumed run rebuilds the same permutation and starts at the saved batch. Each loader also gets its
own `torch.Generator`, which seeds its workers; the global RNG still moves by one number per new
iterator, as under HF (`SeededLoader`), and a resumed run restores it after its iterator is made."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from kiln.engine.data.collator import default_data_collator
from kiln.engine.data.global_draw import global_draw
from kiln.engine.data.samplers import ResumableSampler, ShardedIterable


def is_sized(obj: Any) -> bool:
    try:
        len(obj)
    except TypeError:
        return False
    return True


def build_dataloader(
    dataset: Any,
    batch_size: int,
    collate_fn: Callable[[list[Any]], Any] | None,
    data_cfg: Any,
    seed: int,
    shuffle: bool,
    num_replicas: int = 1,
    rank: int = 0,
    sampler: Sampler[int] | None = None,
    drop_last: bool | None = None,
    pin_memory: bool = False,
    broadcast: Callable[[Any], Any] | None = None,
) -> Any:
    """A DataLoader over `dataset` with kiln's sampler (map-style) or rank sharding (iterable).

    `pin_memory` says whether the device benefits (its accelerator's answer); `dataloader_pin_memory`
    can only switch it off. With `broadcast` (the strategy's broadcast_object; given for training
    loaders), `data.split_batches` makes `batch_size` global and `data.dispatch_batches` has rank 0
    alone read the data (see kiln.engine.data.dispatch_batches)."""
    drop_last = data_cfg.dataloader_drop_last if drop_last is None else drop_last
    even = bool(getattr(data_cfg, "even_batches", True))
    if broadcast is not None:
        from kiln.engine.data.dispatch_batches import DispatchedLoader, per_rank_batch_size

        batch_size = per_rank_batch_size(
            batch_size, bool(getattr(data_cfg, "split_batches", False)), num_replicas, "per_device_train_batch_size"
        )
        if getattr(data_cfg, "dispatch_batches", False) and num_replicas > 1 and sampler is None:
            loader = build_dataloader(
                dataset, batch_size * num_replicas, collate_fn, data_cfg, seed, shuffle, drop_last=drop_last
            )  # the whole data, in global batches
            return DispatchedLoader(loader, broadcast, num_replicas, rank, even)
    kwargs: dict[str, Any] = dict(
        batch_size=batch_size,
        collate_fn=collate_fn or default_data_collator,
        num_workers=data_cfg.dataloader_num_workers,
        pin_memory=bool(data_cfg.dataloader_pin_memory and pin_memory),
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(seed),
    )
    if getattr(data_cfg, "dataloader_multiprocessing_context", None) and data_cfg.dataloader_num_workers > 0:
        kwargs["multiprocessing_context"] = data_cfg.dataloader_multiprocessing_context
    if not getattr(data_cfg, "dataloader_in_order", True):
        kwargs["in_order"] = False
    fetched = None  # what worker processes fetch from, when not `dataset` itself
    if data_cfg.dataloader_num_workers > 0:
        from kiln.engine.data.worker_seeding import SeededSamples, seed_worker

        # different random streams on every rank and worker, exact on resume (see worker_seeding)
        kwargs["worker_init_fn"] = functools.partial(
            seed_worker, num_workers=data_cfg.dataloader_num_workers, rank=rank
        )
        if not isinstance(dataset, IterableDataset) and is_sized(dataset):
            fetched = SeededSamples.wrap(dataset, rank)
        kwargs["persistent_workers"] = data_cfg.dataloader_persistent_workers
        if data_cfg.dataloader_prefetch_factor is not None:
            kwargs["prefetch_factor"] = data_cfg.dataloader_prefetch_factor
    if isinstance(dataset, IterableDataset) or not is_sized(dataset):
        if num_replicas > 1 and not getattr(dataset, "shards_itself", False):
            dataset = ShardedIterable(dataset, num_replicas, rank)
        loader = SeededLoader(dataset, **kwargs)
    else:
        if sampler is None:
            sampler = ResumableSampler(len(dataset), seed, shuffle, num_replicas, rank, drop_last, even, batch_size)
        loader = (
            SeededLoader(dataset, sampler=sampler, **kwargs)
            if fetched is None
            else WorkerSeededLoader(dataset, fetched, sampler=sampler, **kwargs)
        )
    loader.kiln_built = True  # set_epoch re-seeds only the generators kiln made
    return loader


class SeededLoader(DataLoader):
    """kiln's DataLoader: its own generator seeds the workers (exact on resume), and each new iterator
    still draws one number from the global RNG, as HF's loaders (which have no generator) make torch do."""

    def _get_iterator(self) -> Any:
        global_draw()
        return super()._get_iterator()


class WorkerSeededLoader(SeededLoader):
    """A DataLoader whose worker processes fetch through kiln's per-sample seeding wrapper
    (worker_seeding.SeededSamples) while `loader.dataset` stays the user's dataset, as HF's loaders show it."""

    def __init__(self, dataset: Any, fetched: Any, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.fetched = fetched

    def _get_iterator(self) -> Any:
        # the iterator reads `loader.dataset` once, when it is built, and hands it to the workers
        shown = self.__dict__["dataset"]
        self.__dict__["dataset"] = self.fetched  # DataLoader refuses `dataset =` after __init__
        try:
            return super()._get_iterator()
        finally:
            self.__dict__["dataset"] = shown


def set_epoch(loader: Iterable[Any], epoch: int, seed: int) -> None:
    """Prepare the loader for `epoch`: sampler order, iterable datasets, and the worker seeds of a loader kiln
    built (a user's DataLoader keeps its generator's stream, as it would on its own)."""
    # Duck-typed: any loader, sampler or dataset that has the attribute takes part.
    sampler: Any = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    batch_sampler: Any = getattr(loader, "batch_sampler", None)
    if hasattr(getattr(batch_sampler, "sampler", None), "set_epoch") and batch_sampler.sampler is not sampler:
        batch_sampler.sampler.set_epoch(epoch)
    generator = getattr(loader, "generator", None)
    if isinstance(generator, torch.Generator) and getattr(loader, "kiln_built", False):
        generator.manual_seed(seed + epoch)  # a user's loader keeps its own stream (see epoch_rng)
    dataset: Any = getattr(loader, "dataset", None)
    if dataset is not None and hasattr(dataset, "set_epoch"):
        dataset.set_epoch(epoch)
    elif isinstance(getattr(dataset, "generator", None), torch.Generator):
        dataset.generator.manual_seed(seed + epoch)  # HF's contract for randomised iterable datasets


def skip_batches(loader: Iterable[Any], batches: int) -> tuple[Iterator[Any], str]:
    """An iterator over `loader` that starts `batches` batches in, and how it got there.

    kiln's sampler jumps directly ("jump"); an iterable dataset with `load_state_dict` restores
    itself (done by the caller); anything else is iterated past ("iterate")."""
    sampler = getattr(loader, "sampler", None)
    batch_size = getattr(loader, "batch_size", None)
    if batches == 0:
        return epoch_iterator(loader, iter(loader), 0), "none"
    if isinstance(sampler, ResumableSampler) and batch_size:
        sampler.set_start(batches * batch_size)
        return iter(loader), "jump"
    it = iter(loader)
    for _ in range(batches):
        next(it, None)
    return epoch_iterator(loader, it, batches), "iterate"


def reads_to_the_end(loader: Any) -> bool:
    """Whether an epoch reads `loader` as `for batch in loader` does, asking for one batch past the last
    (the signal a plain loop ends on): kiln's own loaders, where the extra request changes nothing, and a
    DataLoader passed as train_dataset (marked `kiln_as_given`), which runs as it would on its own. A
    loader from an overridden get_train_dataloader is read as HF's Trainer reads it instead: exactly
    len(loader) batches per epoch. The difference shows in a shuffling DataLoader's generator: torch's
    RandomSampler draws one more permutation when asked past its end, so HF's next epoch starts elsewhere."""
    from kiln.engine.data.dispatch_batches import DispatchedLoader

    return (
        bool(getattr(loader, "kiln_built", False) or getattr(loader, "kiln_as_given", False))
        or isinstance(loader, DispatchedLoader)
        or not is_sized(loader)
    )


def epoch_iterator(loader: Any, iterator: Iterator[Any], skipped: int) -> Iterator[Any]:
    """`iterator` (already `skipped` batches into the epoch) ending where the epoch ends for the fit loop
    (see reads_to_the_end): the loader's own end, or after len(loader) batches in all."""
    if reads_to_the_end(loader):
        return iterator
    return itertools.islice(iterator, max(len(loader) - skipped, 0))


def loader_length(loader: Iterable[Any]) -> int | None:
    """Batches per epoch, or None for loaders without a length."""
    if not is_sized(loader):
        return None
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def dataset_length(dataset: Any) -> int | None:
    return len(dataset) if isinstance(dataset, Sized) and not isinstance(dataset, IterableDataset) else None


__all__ = [
    "Dataset",
    "DataLoader",
    "WorkerSeededLoader",
    "build_dataloader",
    "set_epoch",
    "skip_batches",
    "epoch_iterator",
    "reads_to_the_end",
    "loader_length",
    "dataset_length",
    "is_sized",
]
