"""The packed rows as datasets: `PackedRows` over a map-style dataset, `PackedStream` over a stream.

A row is a dict of the pieces' per-token tensors concatenated (`input_ids`, `labels`, ...) and
`seq_lengths`, the pieces' lengths in order (TRL's column), from which the collator builds positions,
labels and attention boundaries.

`PackedRows` plans the whole dataset once, from every example's length (one read of each, on every rank,
so all ranks hold the same plan), and is indexed by row: kiln's sampler shuffles, shards and resumes rows
as it does examples. `PackedStream` reads its stream in buffers of `BUFFER` examples and plans each buffer
(TRL packs a `datasets.map` batch of 1000 at a time too). On several ranks each reads every
world-th example of the stream (unless the stream shards itself) and packs its own rows. Its position,
saved in checkpoints through `state_dict`, is the buffer it is in and the rows of it already read: the
stream's own `state_dict()` at the buffer's start when it has one, else the number of examples before it,
which a resumed run reads past; the buffer is then planned again, identically, and its read rows skipped."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from kiln.engine.data.packing.bins import Piece, Plan, plan
from kiln.engine.data.packing.examples import ExampleReader
from kiln.utils.errors import ConfigError

log = logging.getLogger(__name__)

BUFFER = 1000  # examples planned together from a stream


def build_row(pieces: Sequence[Piece], example: Callable[[int], dict[str, torch.Tensor]]) -> dict[str, Any]:
    parts = [(example(p.example), p) for p in pieces]
    keys = list(parts[0][0])
    for tensors, _ in parts[1:]:
        if list(tensors) != keys:
            raise ConfigError(
                f"data.packing put examples with different keys in one row ({keys} and {list(tensors)}); "
                "give every example the same keys (labels in all or in none)."
            )
    row: dict[str, Any] = {k: torch.cat([tensors[k][p.start : p.end] for tensors, p in parts]) for k in keys}
    row["seq_lengths"] = [p.length for p in pieces]
    return row


def report_truncation(packed: Plan, strategy: str, capacity: int, more: bool = False) -> None:
    if packed.truncated:
        log.warning(
            "data.packing (bfd) cut %d example(s) longer than max_length=%d to their first %d tokens, dropping "
            "%d tokens%s; strategy bfd_split or wrapped keeps them.",
            packed.truncated,
            capacity,
            capacity,
            packed.dropped,
            " (so far; later ones are not reported)" if more else "",
        )


class PackedRows(Dataset):
    def __init__(self, dataset: Any, strategy: str, capacity: int, reader: ExampleReader) -> None:
        self.dataset, self.reader = dataset, reader
        lengths = [len(self._example(i)["input_ids"]) for i in range(len(dataset))]
        packed = plan(strategy, lengths, capacity)
        report_truncation(packed, strategy, capacity)
        self.rows = packed.rows

    def _example(self, i: int) -> dict[str, torch.Tensor]:
        return self.reader(self.dataset[i], f"example {i}")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return build_row(self.rows[index], self._example)


class PackedStream(IterableDataset):
    shards_itself = True  # kiln's loader must not deal it out again (see the module docstring)

    def __init__(
        self,
        source: Any,
        strategy: str,
        capacity: int,
        reader: ExampleReader,
        num_replicas: int = 1,
        rank: int = 0,
        buffer: int = BUFFER,
    ) -> None:
        self.source, self.strategy, self.capacity, self.reader = source, strategy, capacity, reader
        self.num_replicas, self.rank, self.buffer = num_replicas, rank, buffer
        self.deals = num_replicas > 1 and not getattr(source, "shards_itself", False)
        # the stream's own position is only meaningful when this rank reads all of it
        self.stateful = (
            not self.deals
            and callable(getattr(source, "state_dict", None))
            and callable(getattr(source, "load_state_dict", None))
        )
        self._position: dict[str, Any] = {"examples": 0, "rows": 0, "source": None}
        self._resume: dict[str, Any] | None = None
        self._reported = False

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return dict(self._position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration starts where `state` was taken (an epoch's iteration after it starts afresh)."""
        self._resume = dict(state)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        resume, self._resume = self._resume, None
        saved_source = resume.get("source") if resume is not None else None
        restore = saved_source is not None and self.stateful
        if restore:
            self.source.load_state_dict(saved_source)
        examples = iter(self.source)
        if self.deals:
            examples = itertools.islice(examples, self.rank, None, self.num_replicas)
        seen, skip_rows = (resume["examples"], resume["rows"]) if resume is not None else (0, 0)
        if resume is not None and not restore:
            next(itertools.islice(examples, seen, seen), None)  # read past the examples before the saved buffer
        self._position = {"examples": seen, "rows": skip_rows, "source": saved_source if restore else None}
        while True:
            source = self.source.state_dict() if self.stateful else None
            buffer = list(itertools.islice(examples, self.buffer))
            if not buffer:
                return
            read = [self.reader(example, f"example {seen + i} of the stream") for i, example in enumerate(buffer)]
            packed = plan(self.strategy, [len(r["input_ids"]) for r in read], self.capacity)
            if not self._reported and packed.truncated:
                report_truncation(packed, self.strategy, self.capacity, more=True)
                self._reported = True
            for k in range(skip_rows, len(packed.rows)):
                self._position = {"examples": seen, "rows": k + 1, "source": source}
                yield build_row(packed.rows[k], read.__getitem__)
            seen, skip_rows = seen + len(buffer), 0
