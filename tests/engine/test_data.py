"""Samplers: seeded order, rank sharding, O(1) resume jumps, length grouping."""

from __future__ import annotations

import torch

from kiln.engine.data.length_grouping import LengthGroupedSampler
from kiln.engine.data.loaders import build_dataloader, skip_batches
from kiln.engine.data.samplers import ResumableSampler


def test_order_depends_only_on_seed_and_epoch():
    a, b = ResumableSampler(10, seed=3), ResumableSampler(10, seed=3)
    assert list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != list(b) and sorted(a) == list(range(10))


def test_ranks_partition_the_permutation_with_padding():
    shards = [list(ResumableSampler(11, seed=0, num_replicas=2, rank=r)) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 6
    assert set(shards[0]) | set(shards[1]) == set(range(11))


def test_skip_jumps_without_touching_skipped_samples():
    touched = []

    class Spy(torch.utils.data.Dataset):
        def __len__(self):
            return 100

        def __getitem__(self, i):
            touched.append(i)
            return torch.tensor([i])

    class Cfg:
        dataloader_drop_last = False
        dataloader_num_workers = 0
        dataloader_pin_memory = False

    loader = build_dataloader(Spy(), 10, None, Cfg(), seed=0, shuffle=True)
    full = [b.flatten().tolist() for b in loader]
    touched.clear()
    it, how = skip_batches(loader, 7)
    rest = [b.flatten().tolist() for b in it]
    assert how == "jump" and rest == full[7:]
    assert len(touched) == 30  # only the 3 remaining batches were loaded
    assert [b.flatten().tolist() for b in loader] == full  # the jump was one-shot


def test_length_grouped_batches_are_homogeneous_and_cover_everything():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 500, (1000,), generator=g).tolist()
    sampler = LengthGroupedSampler(lengths, batch_size=10, seed=0)
    order = list(sampler)
    assert sorted(order) == list(range(1000))
    spread = [
        max(lengths[i] for i in order[b : b + 10]) - min(lengths[i] for i in order[b : b + 10])
        for b in range(0, 1000, 10)
    ]
    random_spread = [max(lengths[b : b + 10]) - min(lengths[b : b + 10]) for b in range(0, 1000, 10)]
    assert sum(spread) < sum(random_spread) / 5
    first_mega = torch.randperm(1000, generator=torch.Generator().manual_seed(0)).tolist()[:500]
    assert lengths[order[0]] == max(lengths[i] for i in first_mega)  # longest batch first


def test_length_grouped_shards_are_disjoint_across_ranks():
    lengths = list(range(64))
    shards = [list(LengthGroupedSampler(lengths, 4, seed=1, num_replicas=2, rank=r)) for r in range(2)]
    assert not set(shards[0]) & set(shards[1]) and len(shards[0]) == len(shards[1]) == 32
