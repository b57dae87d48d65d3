"""Random draws inside DataLoader workers: different on every rank and every worker (HF seeds workers per
rank), and for map-style data a function of the sample alone, so a resumed (jumped) epoch draws exactly
what the uninterrupted one drew, whatever the number of workers."""

from __future__ import annotations

import random

import numpy as np
import torch
from omegaconf import OmegaConf

from kiln.config.schema.data import DataConfig
from kiln.engine.data.loaders import build_dataloader, set_epoch, skip_batches


class Augmenting(torch.utils.data.Dataset):
    """Each sample draws from python's random, numpy and torch, as random augmentation does."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        return torch.tensor(
            [float(i), random.random(), float(np.random.rand()), float(torch.rand(()))], dtype=torch.float64
        )


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for _ in range(8):
            yield torch.tensor([random.random(), float(np.random.rand()), float(torch.rand(()))], dtype=torch.float64)


def _loader(dataset, rank, workers=2, replicas=2, epoch=0):
    cfg = OmegaConf.structured(DataConfig(dataloader_num_workers=workers))
    loader = build_dataloader(dataset, 2, None, cfg, seed=0, shuffle=True, num_replicas=replicas, rank=rank)
    set_epoch(loader, epoch, 0)
    return loader


def _rows(loader):
    return torch.cat(list(loader)).tolist()


def test_ranks_and_workers_draw_different_streams():
    draws = {rank: [v for row in _rows(_loader(Augmenting(), rank)) for v in row[1:]] for rank in (0, 1)}
    assert len(set(draws[0]) | set(draws[1])) == len(draws[0]) + len(draws[1])  # nothing repeats across ranks
    stream = {rank: [v for row in _rows(_loader(Stream(), rank, replicas=1)) for v in row] for rank in (0, 1)}
    assert not set(stream[0]) & set(stream[1])  # iterable data too: each rank's workers are seeded apart


def test_a_jumped_epoch_draws_what_the_full_epoch_drew_with_any_worker_count():
    full = _rows(_loader(Augmenting(), 1, epoch=3))
    loader = _loader(Augmenting(), 1, workers=1, epoch=3)
    it, how = skip_batches(loader, 3)
    assert how == "jump"
    assert torch.cat(list(it)).tolist() == full[6:]
    assert _rows(_loader(Augmenting(), 1, epoch=4)) != full  # a new epoch draws anew
