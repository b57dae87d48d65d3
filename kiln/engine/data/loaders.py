"""Dataloaders: seeded, resumable sampling and the default collator.

Resuming mid-epoch never re-iterates data: the sampler's order depends only on (seed, epoch), so a
resumed run rebuilds the same permutation and starts at the saved batch. Each loader also gets its
own `torch.Generator`, which seeds its workers; the global RNG still moves by one number per new
iterator, as under HF (`SeededLoader`), and a resumed run restores it after its iterator is made."""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info
from torch.utils.data._utils.collate import default_collate

from kiln.engine.data.global_draw import global_draw


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


class ResumableSampler(Sampler[int]):
    """Random (or sequential) order over `num_samples` items, sharded over `num_replicas` ranks like
    torch's DistributedSampler, which can start part-way through an epoch in O(1).

    The permutation is `randperm(n, generator=seed + epoch)`; the shard is padded to a multiple of
    `num_replicas` by repeating from the start (or truncated when `drop_last`)."""

    def __init__(
        self,
        num_samples: int,
        seed: int,
        shuffle: bool = True,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        even: bool = True,
        batch_size: int = 1,
    ) -> None:
        self.n = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0  # indices of this rank's shard to skip, once (resume)
        self.even = even or drop_last or num_replicas == 1
        if drop_last and num_samples % num_replicas:
            self.per_rank = num_samples // num_replicas
        elif self.even:
            self.per_rank = math.ceil(num_samples / num_replicas)
        else:
            # even_batches=false: no repeated samples, so shards differ by one; every rank stops after the
            # last rank's batch count (a rank past it would wait alone in the gradient all-reduce). That
            # leaves out at most num_replicas - 1 samples, and only when the last global batch has fewer
            # samples than there are ranks.
            mine = len(range(rank, num_samples, num_replicas))
            fewest = num_samples // num_replicas
            self.per_rank = min(mine, math.ceil(fewest / batch_size) * batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_start(self, index: int) -> None:
        self.start = index

    def indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        if not self.even:
            return order[self.rank :: self.num_replicas][: self.per_rank]
        total = self.per_rank * self.num_replicas
        if total > len(order):
            order += (order * math.ceil(total / max(len(order), 1)))[: total - len(order)]
        return order[:total][self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        start, self.start = self.start, 0  # one-shot: the next epoch starts at its beginning
        return iter(self.indices()[start:])

    def __len__(self) -> int:
        return self.per_rank


class ShardedIterable(IterableDataset):
    """Every `num_replicas`-th item of an iterable dataset for one rank (when the dataset does not
    shard itself). `set_epoch` is forwarded so datasets can reshuffle per epoch."""

    def __init__(self, dataset: Iterable[Any], num_replicas: int, rank: int) -> None:
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.dataset), self.rank, None, self.num_replicas)


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
    "ResumableSampler",
    "WorkerSeededLoader",
    "ShardedIterable",
    "build_dataloader",
    "default_data_collator",
    "set_epoch",
    "skip_batches",
    "epoch_iterator",
    "reads_to_the_end",
    "loader_length",
    "dataset_length",
    "is_sized",
]


class SequentialDistributedSampler(Sampler[int]):
    """The evaluation sampler: each rank gets one contiguous shard of `range(dataset_len)`, in order.

    The index list is padded to `total_size` by repeating indices from the start (cyclically, so even
    tiny datasets work; HF's version fails there) and rank r gets `[r * num_samples, (r + 1) *
    num_samples)`. With `batch_size`, the shard length is a multiple of it, so every rank runs the
    same number of full batches (HF's TPU layout). `drop_last` (needs `batch_size`) instead cuts the
    dataset to whole global batches, so no rank runs a partial batch and nothing is duplicated.
    `num_examples` is how many distinct samples are evaluated; `OrderedGatherer.for_sampler` matches
    this layout exactly.
    """

    def __init__(
        self, dataset_len: int, num_replicas: int, rank: int, batch_size: int | None = None, drop_last: bool = False
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}.")
        if drop_last and batch_size is None:
            raise ValueError("SequentialDistributedSampler(drop_last=True) needs the batch_size it drops to.")
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.batch_size = batch_size
        self.drop_last = drop_last
        if batch_size is None:
            self.num_samples = math.ceil(dataset_len / num_replicas)
        elif drop_last:
            self.num_samples = dataset_len // (batch_size * num_replicas) * batch_size
        else:
            self.num_samples = math.ceil(dataset_len / (batch_size * num_replicas)) * batch_size
        self.total_size = self.num_samples * num_replicas
        self.num_examples = min(dataset_len, self.total_size)

    def __iter__(self) -> Iterator[int]:
        if self.dataset_len == 0:
            return iter(())
        start = self.rank * self.num_samples
        return (i % self.dataset_len for i in range(start, start + self.num_samples))

    def __len__(self) -> int:
        return self.num_samples


__all__ += ["SequentialDistributedSampler"]
