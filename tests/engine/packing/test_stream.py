"""PackedStream on its own: buffers of examples planned one after another, its saved position (the buffer's
start, as the stream's own state when it has one, else a count of examples to read past, and the rows of the
buffer already read), and a rank's share of a stream that does not shard itself."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln.engine.data.packing.examples import ExampleReader
from kiln.engine.data.packing.rows import PackedStream

EXAMPLES = [{"input_ids": list(range(10 * i + 1, 10 * i + 1 + (i % 5) + 1))} for i in range(23)]


class Plain(torch.utils.data.IterableDataset):
    def __init__(self):
        self.reads = 0

    def __iter__(self):
        for e in EXAMPLES:
            self.reads += 1
            yield e


class Stateful(Plain):
    """A stream that restores its own position (and records that it was asked to)."""

    def __init__(self):
        super().__init__()
        self.at, self.start, self.restored = 0, 0, None

    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, state):
        self.restored = dict(state)
        self.start = state["at"]

    def __iter__(self):
        self.at, self.start = self.start, 0  # an iteration after the restored one starts afresh
        while self.at < len(EXAMPLES):
            self.at += 1
            self.reads += 1
            yield EXAMPLES[self.at - 1]


def stream(source, **kw):
    return PackedStream(source, "bfd", 8, ExampleReader(), buffer=5, **kw)


def ids(rows):
    return [row["input_ids"].tolist() for row in rows]


@pytest.mark.parametrize("kind", [Plain, Stateful])
@pytest.mark.parametrize("stop", [1, 3, 6])
def test_a_stream_resumed_from_its_state_yields_the_rows_it_would_have(kind, stop):
    whole = ids(stream(kind()))
    assert sum(len(r) for r in whole) == sum(len(e["input_ids"]) for e in EXAMPLES)
    first = stream(kind())
    it = iter(first)
    head = ids([next(it) for _ in range(stop)])
    state = first.state_dict()
    source = kind()
    resumed = stream(source)
    resumed.load_state_dict(state)
    assert head + ids(resumed) == whole
    if kind is Stateful:  # restored from its own state at the buffer's start, not read past
        assert source.restored == state["source"] and source.reads == len(EXAMPLES) - state["source"]["at"]
        assert state["source"]["at"] % 5 == 0  # a buffer's start
    else:
        assert state["source"] is None and source.reads == len(EXAMPLES)
        assert state["examples"] % 5 == 0
    assert ids(resumed) == whole  # the next epoch starts afresh


def test_each_rank_packs_every_other_example_of_a_stream_that_does_not_shard_itself():
    shares = [ids(stream(Plain(), num_replicas=2, rank=r)) for r in (0, 1)]
    for rank, rows in enumerate(shares):
        tokens = sorted(t for row in rows for t in row)
        assert tokens == sorted(t for e in EXAMPLES[rank::2] for t in e["input_ids"])


def test_a_stream_reports_the_first_buffer_that_cut_examples(caplog):
    long = [{"input_ids": list(range(1, 12))}] * 3
    with caplog.at_level(logging.WARNING):
        rows = list(PackedStream(long, "bfd", 8, ExampleReader(), buffer=1))
    assert len(rows) == 3
    assert caplog.text.count("cut 1 example(s) longer than max_length=8") == 1
    assert "(so far; later ones are not reported)" in caplog.text
