"""The input pipeline's settings and its per-sample cost: HF's defaults (no workers, memory pinned only where a
device benefits), the worker settings passed through as given, and kiln's per-sample seeding in worker
processes done without torch.manual_seed's lazy device seeds (a formatted stack trace each, per sample)."""

from __future__ import annotations

import random
import traceback
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from kiln.config.schema.data import DataConfig
from kiln.engine.data import worker_seeding
from kiln.engine.data.loaders import WorkerSeededLoader, build_dataloader
from kiln.engine.data.worker_seeding import SeededSamples


class Augmenting(torch.utils.data.Dataset):
    """Each sample draws from python's random, numpy and torch, as random augmentation does."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> list[float]:
        return [float(i), random.random(), float(np.random.rand()), float(torch.rand(()))]


def _loader(pin_memory: bool = False, **data: object) -> torch.utils.data.DataLoader:
    cfg = OmegaConf.structured(DataConfig(**data))
    return build_dataloader(Augmenting(), 2, None, cfg, seed=0, shuffle=True, pin_memory=pin_memory)


def test_defaults_are_hfs_and_pin_memory_only_where_the_device_benefits():
    loader = _loader()  # the CPU accelerator's answer: pinning does not help
    assert (loader.num_workers, loader.pin_memory, loader.persistent_workers, loader.prefetch_factor) == (
        0,
        False,
        False,
        None,
    )
    assert _loader(pin_memory=True).pin_memory is True  # CUDA's answer, with dataloader_pin_memory's default (true)
    assert (
        _loader(pin_memory=True, dataloader_pin_memory=False).pin_memory is False
    )  # the option can only switch it off


def test_worker_settings_are_passed_through():
    loader = _loader(dataloader_num_workers=2, dataloader_persistent_workers=True, dataloader_prefetch_factor=4)
    assert isinstance(loader, WorkerSeededLoader)  # per-sample seeds in the workers (worker_seeding)
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (2, True, 4)
    assert _loader(dataloader_num_workers=2).prefetch_factor == 2  # unset: torch's default


@pytest.fixture
def _global_rng():
    """The test re-seeds the process's streams as a worker would: put them back for the tests after it."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


@pytest.mark.skipif(
    torch.cuda.is_available() or torch.backends.mps.is_available(),
    reason="a usable device stream is still seeded, lazily where its runtime is not started",
)
def test_a_worker_seeds_once_per_batch_without_lazy_device_seeds(monkeypatch, _global_rng):
    """Per fetched batch, one seed from its first index, and only for streams that can draw: torch.manual_seed
    would queue one for cuda, xpu and mtia even without them, each with traceback.format_stack() (~2,500
    Python calls, hundreds of µs in a worker's stack). The draws are those the full seeding gives."""
    info = SimpleNamespace(seed=1234, id=1)
    monkeypatch.setattr(worker_seeding, "get_worker_info", lambda: info)  # as inside worker 1
    mixed, stacks = [], []
    real_mix, real_stack = worker_seeding._mix, traceback.format_stack
    monkeypatch.setattr(worker_seeding, "_mix", lambda *v: mixed.append(v) or real_mix(*v))
    monkeypatch.setattr(traceback, "format_stack", lambda *a, **k: stacks.append(1) or real_stack(*a, **k))
    rows = SeededSamples(Augmenting(), rank=1).__getitems__([5, 2, 7, 0])
    assert mixed == [(info.seed - info.id, 1, 5)] and stacks == []
    worker_seeding._seed_all(real_mix(info.seed - info.id, 1, 5))
    assert rows == [
        Augmenting()[i] for i in (5, 2, 7, 0)
    ]  # one stream through the batch, as torch.manual_seed seeds it
    assert stacks  # the check above sees the stacks torch.manual_seed formats


def test_the_fetcher_takes_the_batch_path():
    """torch's fetcher calls `__getitems__` when the wrapper has one: kiln's loaders batch, so no per-sample seed."""
    from torch.utils.data._utils.fetch import _MapDatasetFetcher

    calls = []
    wrapped = SeededSamples(Augmenting(), rank=0)
    wrapped._reseed = calls.append  # type: ignore[method-assign]
    batch = _MapDatasetFetcher(wrapped, True, lambda b: b, False).fetch([3, 1, 4])
    assert calls == [3] and [row[0] for row in batch] == [3.0, 1.0, 4.0]
