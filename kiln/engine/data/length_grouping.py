"""HF's `group_by_length` (`train_sampling_strategy="group_by_length"`): batches of similar-length
samples (less padding), still random, and resumable.

The order is HF's `get_length_grouped_indices`: a random permutation cut into megabatches of
`min(n // (4·B), 50)·B` samples (B is HF's grouping unit, the per-device batch times the accumulation
steps), each sorted longest first, and the longest sample of all swapped to the very front, so an
out-of-memory error shows on the first step. Ranks take every world-th per-device batch of that
order, which is what accelerate's batch sharding gives HF.

Lengths, as HF reads them: a `datasets.Dataset` that has the `length_column_name` column gives them
in one read; otherwise `len(item[input_name])` of every item (`input_ids`, or the processing class's
first model input). The Trainer looks for the column after `remove_unused_columns` has dropped what
forward does not take, as HF does, so with HF models it counts only with remove_unused_columns=false
(or when forward takes it). kiln also reads the column from the dict items of other datasets (HF
ignores it there). And HF draws the permutation from the global torch RNG as the epoch starts, which
no resume could replay: kiln draws it from `data_seed + epoch` (seed when data_seed is unset)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kiln.engine.data.samplers import ResumableSampler
from kiln.utils.errors import ConfigError

MEGABATCH = 50  # HF's cap on the megabatch multiple


def sample_lengths(dataset: Any, column: str, input_name: str = "input_ids") -> list[int]:
    """The length of every sample: the `column` of a `datasets.Dataset` (one read), the `column` key of
    dict items, else `len(item[input_name])`."""
    from kiln.engine.data.columns import is_datasets_dataset

    if is_datasets_dataset(dataset) and column in dataset.column_names:
        values = dataset[column]
        return [int(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values)]
    lengths = []
    for i in range(len(dataset)):
        item = dataset[i]
        if not isinstance(item, Mapping) or (column not in item and input_name not in item):
            raise ConfigError(
                f"group_by_length reads each sample's length from its {column!r} or the length of its "
                f"{input_name!r}, but sample {i} is a {type(item).__name__} without either: add one of the "
                "keys, or set group_by_length=false."
            )
        lengths.append(int(item[column]) if column in item else len(item[input_name]))
    return lengths


def length_grouped_indices(lengths: Sequence[int], group: int, generator: torch.Generator | None) -> list[int]:
    """HF's `get_length_grouped_indices(lengths, group, generator=generator)`, step for step."""
    mult = min(len(lengths) // (group * 4), MEGABATCH) or 1
    indices = torch.randperm(len(lengths), generator=generator)
    size = mult * group
    megabatches = [
        sorted(indices[i : i + size].tolist(), key=lambda j: lengths[j], reverse=True)
        for i in range(0, len(lengths), size)
    ]
    longest = int(torch.argmax(torch.tensor([lengths[m[0]] for m in megabatches])).item())
    megabatches[0][0], megabatches[longest][0] = megabatches[longest][0], megabatches[0][0]
    return [i for m in megabatches for i in m]


class LengthGroupedSampler(ResumableSampler):
    """`batch_size`: the per-device batch (the unit ranks take in turn); `group`: HF's grouping unit,
    the per-device batch times the accumulation steps (defaults to `batch_size`)."""

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        seed: int,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        group: int | None = None,
    ) -> None:
        super().__init__(len(lengths), seed, True, num_replicas, rank, drop_last)
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.group = group or batch_size

    @classmethod
    def for_dataset(
        cls,
        dataset: Any,
        data_cfg: Any,
        seed: int,
        batch_size: int,
        accumulation: int,
        shards: int,
        rank: int,
        input_name: str = "input_ids",
    ) -> LengthGroupedSampler:
        lengths = sample_lengths(dataset, data_cfg.length_column_name, input_name)
        return cls(
            lengths, batch_size, seed, shards, rank, data_cfg.dataloader_drop_last, group=batch_size * accumulation
        )

    def indices(self) -> list[int]:
        if not self.lengths:
            return []
        grouped = length_grouped_indices(
            self.lengths, self.group, torch.Generator().manual_seed(self.seed + self.epoch)
        )
        total = self.per_rank * self.num_replicas
        if total > len(grouped):
            grouped += grouped[: total - len(grouped)]
        grouped = grouped[:total]
        # rank r takes every num_replicas-th batch-sized slice of the global order
        per = self.batch_size
        out: list[int] = []
        for b in range(0, total, per * self.num_replicas):
            out += grouped[b + self.rank * per : b + (self.rank + 1) * per]
        return out
