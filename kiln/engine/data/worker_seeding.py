"""Random streams inside DataLoader worker processes: different on every rank and every worker, and
exact on resume.

torch seeds worker w with `base_seed + w`, where `base_seed` comes from the loader's generator, which
kiln seeds alike on every rank: without more, rank 0 and rank 1 would draw the same random augmentations.
kiln therefore (1) seeds each worker at start-up by HF's rule, `base + w + num_workers * rank`, and
(2) for map-style datasets re-seeds `random`, numpy and torch before each fetched batch from (base seed,
rank, the batch's first index). The draws for a batch then depend only on (seed, epoch, rank, the batch's
samples) - not on which worker fetched it or how many came before - so a run resumed mid-epoch, whose
sampler jumps to a batch and whose workers restart, draws exactly what the uninterrupted run drew."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
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


_seeders: tuple[int, list[Callable[[int], Any]]] = (-1, [])


def _sample_seeders() -> list[Callable[[int], Any]]:
    """What `_seed_all` seeds, less the device kinds this process cannot use, worked out once per process.

    torch.manual_seed queues a lazy seed for every device kind whose runtime is not started (cuda, xpu, mtia,
    even where torch was built without them or no device exists), and each queued seed records
    `traceback.format_stack()`: about 100 µs per call inside a worker's deep stack, which per sample would
    cost more than many a transform. A kind that is not available can never draw, so leaving it out changes
    no random number; where one is available (and not unusable after a fork) it is still seeded per sample."""
    global _seeders
    pid = os.getpid()  # a forked worker decides for itself: fork-safety differs from the parent's
    if _seeders[0] != pid:
        seeders: list[Callable[[int], Any]] = [random.seed]
        try:
            import numpy as np

            seeders.append(lambda seed: np.random.seed(seed % 2**32))
        except ImportError:
            pass
        seeders.append(torch.default_generator.manual_seed)
        for name in ("cuda", "xpu", "mtia"):
            device = getattr(torch, name, None)
            if device is not None and device.is_available() and not device._is_in_bad_fork():
                seeders.append(device.manual_seed_all)
        if torch.backends.mps.is_available():
            seeders.append(torch.mps.manual_seed)
        if hasattr(torch, torch._C._get_privateuse1_backend_name()):  # a registered custom device: torch's rule
            seeders.append(torch.random._seed_custom_device)
        _seeders = (pid, seeders)
    return _seeders[1]


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
    """A map-style dataset whose batches are fetched under their own seed in worker processes."""

    def __init__(self, dataset: Any, rank: int) -> None:
        self.dataset, self.rank = dataset, rank

    @staticmethod
    def wrap(dataset: Any, rank: int) -> SeededSamples:
        return SeededSamples(dataset, rank)

    def _reseed(self, index: Any) -> None:
        info = get_worker_info()
        if info is not None:  # the main process's streams are kiln's to save and restore
            seed = _mix(info.seed - info.id, self.rank, index)
            for seeder in _sample_seeders():
                seeder(seed)

    def __getitems__(self, indices: list[int]) -> Any:
        """The batch `indices` (the fetcher's call when the loader batches), its samples drawing one after
        another from one seed, that of its first index. Re-seeding before every sample instead costs a few
        µs each (Python's and numpy's Mersenne Twisters are re-initialised from scratch), as much as a light
        per-sample transform; a batch is what a resume jumps to, so its draws are exact on resume all the same."""
        self._reseed(indices[0] if indices else 0)
        if hasattr(self.dataset, "__getitems__"):  # datasets that fetch whole batches (HF datasets)
            return self.dataset.__getitems__(indices)
        dataset = self.dataset
        return [dataset[i] for i in indices]

    def __getitem__(self, index: int) -> Any:  # a loader that does not batch (batch_size=None) fetches per sample
        self._reseed(index)
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:  # column names, set_epoch, ... of the wrapped dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)
