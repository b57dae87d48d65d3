"""The position inside the epoch on resume: kiln's sampler jumps straight to the batch (skipped
samples are never loaded), iterable datasets restore their own `state_dict()`, anything else is
iterated past with a note, and `ignore_data_skip` starts the epoch over."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.checkpoint.checkpoint_helpers import Crash, StatefulStream, Stream, regression_data, train

# 40 samples, batch 4: 10 batches per epoch. Step 13 is 3 batches into the second epoch.
CFG = {"max_steps": 16, "save_steps": 13}


class Counting(list):
    """A map-style dataset that records every index it is asked for."""

    def __init__(self, items):
        super().__init__(items)
        self.seen: list[int] = []

    def __getitem__(self, index):
        self.seen.append(index)
        return super().__getitem__(index)


def crash_then_resume(tmp_path, data_factory, **cfg):
    out = str(tmp_path / "run")
    with pytest.raises(Crash):
        train(out, {**CFG, **cfg}, data_factory, crash_at=13)
    holder = {}

    def make():
        holder["data"] = data_factory()
        return holder["data"]

    trainer = train(out, {**CFG, **cfg}, make, model_seed=3, resume=True)
    return trainer, holder["data"]


def epoch_order(epoch: int, seed: int = 7) -> list[int]:
    return torch.randperm(40, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def test_map_style_resume_jumps_without_loading_skipped_samples(tmp_path):
    trainer, data = crash_then_resume(tmp_path, lambda: Counting(regression_data()))
    assert trainer.state.global_step == 16
    # sample 0 once, by the Trainer's first-item check at construction; then exactly the 3 remaining
    # batches of the epoch, nothing before them
    assert data.seen == [0] + epoch_order(1)[12:24]


def test_ignore_data_skip_starts_the_epoch_over(tmp_path):
    trainer, data = crash_then_resume(tmp_path, lambda: Counting(regression_data()), ignore_data_skip=True)
    assert trainer.state.global_step == 16
    assert data.seen == [0] + epoch_order(1)[:12]  # the first-item check, then the epoch from its start


class CountingStream(StatefulStream):
    def __init__(self):
        super().__init__(n=40)
        self.yielded = 0
        self.restored = None

    def load_state_dict(self, state):
        self.restored = dict(state)
        super().load_state_dict(state)

    def __iter__(self):
        for item in super().__iter__():
            self.yielded += 1
            yield item


def test_iterable_dataset_restores_its_own_state(tmp_path):
    _, data = crash_then_resume(tmp_path, CountingStream)
    assert data.restored == {"pos": 12}  # 3 batches of 4 into the second pass
    assert data.yielded == 12  # nothing re-read


def test_iterable_dataset_without_state_is_iterated_past_with_a_note(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kiln.engine.checkpoint.manager"):
        trainer, _ = crash_then_resume(tmp_path, lambda: Stream(n=40))
    assert trainer.state.global_step == 16
    assert "skipping the first 3 batches of the epoch by iterating over them" in caplog.text
    assert "ignore_data_skip" in caplog.text


def _batches(dataset, skip, saved, caplog):
    """What `resume_iterator` yields `skip` batches into a 3-batch epoch of `dataset`, and what it warned."""
    from torch.utils.data import DataLoader

    from kiln.engine.checkpoint.data_position import resume_iterator

    loader = DataLoader(dataset, batch_size=4)
    with caplog.at_level(logging.WARNING, logger="kiln.engine.checkpoint.data_position"):
        batches = list(resume_iterator(loader, skip, saved, main=True, progress=False))
    return [b["x"] for b in batches], caplog.text


@pytest.mark.parametrize(
    "dataset, saved, why",
    [  # only one side records the dataset's position: neither restores it, the epoch is iterated past
        (StatefulStream, None, "the checkpoint holds no position of the dataset"),
        (Stream, {"pos": 4}, "the dataset has no state_dict()"),
    ],
    ids=["only_the_run_is_stateful", "only_the_checkpoint_holds_a_position"],
)
def test_a_position_on_one_side_only_is_iterated_past(dataset, saved, why, caplog):
    whole = torch.stack([item["x"] for item in regression_data(12, seed=2)])
    got, warned = _batches(dataset(n=12), 2, saved, caplog)
    assert len(got) == 1 and torch.equal(got[0], whole[8:12])  # the third batch, not a restored position
    assert "skipping the first 2 batches of the epoch by iterating over them" in warned and why in warned


def test_a_position_on_both_sides_is_restored_not_iterated_past(caplog):
    whole = torch.stack([item["x"] for item in regression_data(12, seed=2)])
    got, warned = _batches(StatefulStream(n=12), 2, {"pos": 4}, caplog)  # the saved position wins over skip
    assert [len(b) for b in got] == [4, 4] and torch.equal(torch.cat(got), whole[4:12])
    assert "iterating over them" not in warned


def test_jump_cost_does_not_depend_on_the_position():
    """The sampler's work to start at batch b is one permutation, whatever b is."""
    from kiln.engine.data.samplers import ResumableSampler

    calls = []
    sampler = ResumableSampler(100_000, seed=0)
    real = sampler.indices
    sampler.indices = lambda: calls.append(1) or real()  # type: ignore[method-assign]
    for start in (8, 99_992):
        sampler.set_start(start)
        first = next(iter(sampler))
        assert first == real()[start]
    assert len(calls) == 2


class Holding(StatefulStream):
    """A stream whose saved position is whatever it is given."""

    def __init__(self, state):
        super().__init__(n=4)
        self.state = state

    def state_dict(self):
        return self.state


PLAIN = {"pos": 3, "shard": (1, "a", 2.5, None, True, b"x"), "rng": [torch.ones(2)], 7: {"nested": [0]}}


def test_a_dataset_position_of_plain_values_is_saved_as_it_is():
    from torch.utils.data import DataLoader

    from kiln.engine.checkpoint.data_position import dataset_state

    assert dataset_state(DataLoader(Holding(PLAIN), batch_size=2)) is PLAIN
    assert dataset_state(DataLoader(Stream(n=4), batch_size=2)) is None  # nothing to save without state_dict()


@pytest.mark.parametrize(
    "state",
    [{"pos": object()}, {"pos": [1, {2}]}, {(1, 2): 0}, ({"pos": 1.5j},)],
    ids=["object", "set_in_a_list", "tuple_key", "complex_in_a_tuple"],
)
def test_a_dataset_position_that_only_unpickling_could_load_is_refused_in_one_sentence(state):
    from torch.utils.data import DataLoader

    from kiln.engine.checkpoint.data_position import dataset_state
    from kiln.utils.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"^Holding\.state_dict\(\) returned objects other than tensors, numbers"):
        dataset_state(DataLoader(Holding(state), batch_size=2))


class SavesOnly(Stream):
    def state_dict(self):  # no load_state_dict: a position it could not restore
        return {"pos": self.pos}


class MapWithState(list):
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_only_a_main_process_iterable_dataset_that_saves_and_restores_has_a_position():
    from types import SimpleNamespace

    from torch.utils.data import DataLoader

    from kiln.engine.checkpoint.data_position import dataset_state, stateful_dataset

    assert stateful_dataset(DataLoader(StatefulStream(n=4), batch_size=2, num_workers=2)) is None  # workers prefetch
    assert stateful_dataset(DataLoader(SavesOnly(n=4), batch_size=2)) is None
    assert stateful_dataset(DataLoader(MapWithState(regression_data(4)), batch_size=2)) is None  # the sampler's job
    own = StatefulStream(n=4)  # a loader of the user's own, without num_workers: iterated in this process
    assert stateful_dataset(SimpleNamespace(dataset=own)) is own
    assert dataset_state(SimpleNamespace(dataset=own)) == {"pos": 0}


def test_at_the_epoch_start_nothing_is_skipped_and_one_batch_in_is_iterated_past(caplog):
    whole = torch.stack([item["x"] for item in regression_data(12, seed=2)])
    got, warned = _batches(Stream(n=12), 0, None, caplog)
    assert torch.equal(torch.cat(got), whole) and not warned
    from torch.utils.data import DataLoader

    from kiln.engine.checkpoint.data_position import resume_iterator

    rows = regression_data(12, seed=2)  # map-style, but not kiln's sampler: iterated past, then to the epoch's end
    batches = list(resume_iterator(DataLoader(rows, batch_size=4), 1, None, main=False, progress=False))
    assert torch.equal(torch.cat([b["x"] for b in batches]), whole[4:])


class Bar:
    """tqdm as `_iterate_past` drives it: each update, and whether it was closed."""

    made: list[Bar] = []

    def __init__(self, total, desc, unit):
        self.total, self.n, self.updates, self.closed = total, 0, [], False
        Bar.made.append(self)

    def update(self, k):
        self.n += k
        self.updates.append(k)

    def close(self):
        self.closed = True


@pytest.mark.parametrize("skip, bar", [(999, False), (1000, True), (1234, True)])
def test_a_long_skip_shows_a_progress_bar_that_ends_at_the_skip(skip, bar, monkeypatch):
    import tqdm.auto

    from kiln.engine.checkpoint.data_position import resume_iterator

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    Bar.made = []
    rows = list(range(skip + 3))
    assert list(resume_iterator(rows, skip, None, main=True, progress=True)) == rows[skip:]
    if bar:
        [made] = Bar.made
        assert made.total == made.n == skip and made.closed
        assert made.updates == [100] * (skip // 100) + [skip % 100]  # every 100 batches, then the rest
    for main, progress in ((True, False), (False, True)):  # a bar only on the main process, with progress on
        assert list(resume_iterator(rows, skip, None, main=main, progress=progress)) == rows[skip:]
    assert len(Bar.made) == int(bar)
