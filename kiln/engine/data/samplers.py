"""The samplers kiln's loaders draw with: `ResumableSampler` (training: seeded by (seed, epoch), sharded over ranks,
started part-way through an epoch in O(1)), `ShardedIterable` (an iterable dataset's items for one rank) and
`SequentialDistributedSampler` (evaluation: one contiguous, in-order shard per rank)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, Sampler


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
