"""Random streams inside DataLoader worker processes: different on every rank and every worker, and
exact on resume.

torch seeds worker w with `base_seed + w`, where `base_seed` comes from the loader's generator, which
kiln seeds alike on every rank: without more, rank 0 and rank 1 would draw the same random augmentations.
kiln therefore (1) seeds each worker at start-up by HF's rule, `base + w + num_workers * rank`, and
(2) for map-style datasets re-seeds `random`, numpy and torch before each fetched sample (or batch, for
datasets with `__getitems__`) from (base seed, rank, index). The draws for a sample then depend only on
(seed, epoch, rank, index) - not on which worker fetched it or how many came before - so a run resumed
mid-epoch, whose sampler jumps and whose workers restart, draws exactly what the uninterrupted run drew."""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

_MASK = 2**63 - 1


def _seed_all(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)


def seed_worker(worker_id: int, num_workers: int, rank: int) -> None:
    """HF's `seed_worker`: a different seed for every (rank, worker) pair (a DataLoader worker_init_fn)."""
    _seed_all(torch.initial_seed() % 2**32 + num_workers * rank)


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix-style), so near-equal inputs give unrelated streams."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (int(v) & _MASK)) * 0xBF58476D1CE4E5B9) & _MASK
        h ^= h >> 31
    return h


class SeededSamples(Dataset):
    """A map-style dataset whose samples are fetched under per-sample seeds in worker processes."""

    def __init__(self, dataset: Any, rank: int) -> None:
        self.dataset, self.rank = dataset, rank

    @staticmethod
    def wrap(dataset: Any, rank: int) -> "SeededSamples":
        """The wrapper; datasets that fetch whole batches (`__getitems__`, HF datasets) get one seed per batch."""
        return (SeededBatches if hasattr(dataset, "__getitems__") else SeededSamples)(dataset, rank)

    def _reseed(self, index: Any) -> None:
        info = get_worker_info()
        if info is not None:  # the main process's streams are kiln's to save and restore
            _seed_all(_mix(info.seed - info.id, self.rank, index))

    def __getitem__(self, index: int) -> Any:
        self._reseed(index)
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:  # column names, set_epoch, ... of the wrapped dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class SeededBatches(SeededSamples):
    def __getitems__(self, indices: list[int]) -> Any:
        self._reseed(indices[0] if indices else 0)
        return self.dataset.__getitems__(indices)
