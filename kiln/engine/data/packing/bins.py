"""Which tokens of which examples go into which row: the packing plans, on lengths alone.

A row is a list of pieces `(example, start, end)`: tokens `start:end` of example `example` (an index into
the lengths given). Each piece is trained as an example of its own (its positions restart at 0 and its
attention stays inside it), so a plan decides exactly what the model sees.

- `bfd`: best-fit decreasing, as TRL's: examples longest first, each into the fullest row it still fits
  (a new row when none has room). An example longer than the row keeps its first `capacity` tokens.
- `bfd_split`: the same over pieces: an overlong example is cut into `capacity`-token pieces first (the
  last one shorter), which are placed like examples, so no token is dropped.
- `wrapped`: the examples in order, concatenated and cut every `capacity` tokens: every row is full but
  the last, and an example cut at a row's end continues at the start of the next row as a new piece.

Empty examples hold no token and are left out. The best fit is found with a max-tree over the free
space of the open rows (TRL's segment tree), so a plan costs O(n log capacity)."""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from typing import NamedTuple


class Piece(NamedTuple):
    example: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


class Plan(NamedTuple):
    rows: list[list[Piece]]
    #: examples longer than a row that `bfd` cut, and the tokens it dropped from them
    truncated: int
    dropped: int


def plan(strategy: str, lengths: Sequence[int], capacity: int) -> Plan:
    """The rows of `strategy` (bfd, bfd_split or wrapped) over examples of `lengths`, `capacity` tokens each."""
    if strategy == "wrapped":
        return Plan(wrapped(lengths, capacity), 0, 0)
    pieces: list[Piece] = []
    truncated = dropped = 0
    for i, n in enumerate(lengths):
        if n > capacity and strategy == "bfd":
            truncated, dropped = truncated + 1, dropped + n - capacity
            n = capacity
        pieces += [Piece(i, s, min(s + capacity, n)) for s in range(0, n, capacity)]
    return Plan(best_fit_decreasing(pieces, capacity), truncated, dropped)


def wrapped(lengths: Sequence[int], capacity: int) -> list[list[Piece]]:
    rows: list[list[Piece]] = [[]]
    free = capacity
    for i, n in enumerate(lengths):
        start = 0
        while start < n:
            if not free:
                rows.append([])
                free = capacity
            end = min(n, start + free)
            rows[-1].append(Piece(i, start, end))
            free -= end - start
            start = end
    return rows if rows[0] else []


def best_fit_decreasing(pieces: Sequence[Piece], capacity: int) -> list[list[Piece]]:
    """Each piece (none longer than `capacity`), longest first and in order among equals, into the open row
    with the least free space that still holds it, else into a new row."""
    tree = _FreeSpace(capacity)
    open_rows: dict[int, deque[int]] = defaultdict(deque)  # free space -> rows with that much left, oldest first
    rows: list[list[Piece]] = []
    free: list[int] = []
    for piece in sorted(pieces, key=lambda p: -p.length):  # sorted() is stable: equal lengths keep their order
        space = tree.smallest_at_least(piece.length)
        if space is None:
            rows.append([])
            free.append(capacity)
            row = len(rows) - 1
        else:
            row = open_rows[space].popleft()
            if not open_rows[space]:
                tree.remove(space)
        rows[row].append(piece)
        free[row] -= piece.length
        if free[row]:
            if not open_rows[free[row]]:
                tree.add(free[row])
            open_rows[free[row]].append(row)
    return rows


class _FreeSpace:
    """The set of free-space values (1..capacity) that some open row has, as a max-tree over the values:
    the smallest value >= n is found by walking down, left whenever the left half holds one."""

    def __init__(self, capacity: int) -> None:
        self.size = 1 << max(capacity - 1, 0).bit_length()
        self.tree = [0] * (2 * self.size)

    def _set(self, value: int, present: bool) -> None:
        i = self.size + value - 1
        self.tree[i] = value if present else 0
        while i > 1:
            i >>= 1
            left, right = self.tree[2 * i], self.tree[2 * i + 1]
            self.tree[i] = left if left >= right else right

    def add(self, value: int) -> None:
        self._set(value, True)

    def remove(self, value: int) -> None:
        self._set(value, False)

    def smallest_at_least(self, n: int) -> int | None:
        if self.tree[1] < n:
            return None
        i = 1
        while i < self.size:
            i = 2 * i if self.tree[2 * i] >= n else 2 * i + 1
        return self.tree[i]
