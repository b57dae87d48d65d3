"""With dataloader workers, random augmentation draws anew every epoch and the same on every rerun.

Worker seeds come from the loader's generator, which `set_epoch` re-seeds with `seed + epoch`. Seeded
with `seed` alone, every epoch would hand the workers the same base seed: each sample would get the same
"random" crop every epoch. Order-level checks cannot see that (the sampler reshuffles per epoch, so the
rows still differ), so the draws are compared per sample index."""

from __future__ import annotations

import random

import torch
from omegaconf import OmegaConf

from kiln.config.schema.data import DataConfig
from kiln.engine.data.loaders import build_dataloader, set_epoch


class Augmenting(torch.utils.data.Dataset):
    """Row = [index, a python-random draw, a torch draw], as a random augmentation would draw."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), random.random(), float(torch.rand(()))], dtype=torch.float64)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(4):
            yield torch.tensor([float(i), random.random(), float(torch.rand(()))], dtype=torch.float64)


class GeneratorStream(torch.utils.data.IterableDataset):
    """An iterable dataset shuffling with its own `generator` (HF's contract: set_epoch re-seeds it)."""

    def __init__(self) -> None:
        self.generator = torch.Generator()

    def __iter__(self):
        yield from torch.randperm(16, generator=self.generator)[:6].double().reshape(3, 2)


SEED = 11


def _loader(dataset, workers: int = 2, shuffle: bool = True):
    cfg = OmegaConf.structured(DataConfig(dataloader_num_workers=workers))
    return build_dataloader(dataset, 2, None, cfg, seed=SEED, shuffle=shuffle, num_replicas=1, rank=0)


def _by_index(loader, epoch: int) -> dict[float, list[float]]:
    set_epoch(loader, epoch, SEED)
    return {row[0]: row[1:] for row in torch.cat(list(loader)).tolist()}


def test_map_style_samples_draw_anew_each_epoch_and_the_same_on_a_rerun():
    loader = _loader(Augmenting())
    epochs = [_by_index(loader, epoch) for epoch in range(3)]  # one loader, as the fit loop uses it
    for a, b in ((0, 1), (1, 2), (0, 2)):
        assert all(epochs[a][i] != epochs[b][i] for i in epochs[a]), (a, b)
    assert _by_index(_loader(Augmenting()), 1) == epochs[1]  # a fresh loader (a resumed run) at epoch 1


def test_iterable_workers_draw_anew_each_epoch_and_the_same_on_a_rerun():
    loader = _loader(Stream(), shuffle=False)
    first, second = _by_index(loader, 0), _by_index(loader, 1)
    assert first.keys() == second.keys() and all(first[i] != second[i] for i in first)
    assert _by_index(_loader(Stream(), shuffle=False), 1) == second


def test_an_iterable_datasets_own_generator_is_reseeded_per_epoch():
    loader = _loader(GeneratorStream(), workers=0, shuffle=False)
    rows = []
    for epoch in (0, 1):
        set_epoch(loader, epoch, SEED)
        rows.append(torch.cat(list(loader)).tolist())
    assert rows[0] != rows[1]
    fresh = _loader(GeneratorStream(), workers=0, shuffle=False)
    set_epoch(fresh, 1, SEED)
    assert torch.cat(list(fresh)).tolist() == rows[1]
