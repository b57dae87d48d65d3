"""HF's `group_by_length`: batches of similar-length samples (less padding), still random and
resumable. Megabatches of 50 batches are drawn from the seeded permutation and sorted by length,
longest first, so an out-of-memory error shows up on the first step rather than mid-run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Sequence

import torch

from kiln.engine.data.loaders import ResumableSampler

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.strategies.base import Strategy

MEGABATCH = 50


def sample_lengths(dataset: Any, column: str) -> list[int]:
    """`dataset[i][column]` when present, else the length of `input_ids` (computed once)."""
    lengths = []
    for i in range(len(dataset)):
        item = dataset[i]
        if not isinstance(item, Mapping):
            raise ValueError("group_by_length needs dict samples with input_ids or a length column.")
        if column in item:
            lengths.append(int(item[column]))
        elif "input_ids" in item:
            lengths.append(len(item["input_ids"]))
        else:
            raise ValueError(f"group_by_length needs each sample to hold '{column}' or 'input_ids'.")
    return lengths


class LengthGroupedSampler(ResumableSampler):
    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int, num_replicas: int = 1, rank: int = 0,
                 drop_last: bool = False) -> None:
        super().__init__(len(lengths), seed, True, num_replicas, rank, drop_last)
        self.lengths = list(lengths)
        self.batch_size = batch_size

    @classmethod
    def for_dataset(cls, dataset: Any, config: "DictConfig", seed: int, strategy: "Strategy") -> "LengthGroupedSampler":
        lengths = sample_lengths(dataset, config.data.length_column_name)
        return cls(lengths, config.data.per_device_train_batch_size, seed, strategy.data_shards,
                   strategy.data_shard_rank, config.data.dataloader_drop_last)

    def indices(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        # Global batches span every rank, so each rank's slice of a megabatch has similar lengths.
        size = MEGABATCH * self.batch_size * self.num_replicas
        grouped: list[int] = []
        for start in range(0, len(order), size):
            grouped += sorted(order[start:start + size], key=lambda i: -self.lengths[i])
        total = self.per_rank * self.num_replicas
        if total > len(grouped):
            grouped += grouped[: total - len(grouped)]
        grouped = grouped[:total]
        # rank r takes every num_replicas-th batch-sized slice of the global order
        per = self.batch_size
        out: list[int] = []
        for b in range(0, total, per * self.num_replicas):
            out += grouped[b + self.rank * per: b + (self.rank + 1) * per]
        return out
