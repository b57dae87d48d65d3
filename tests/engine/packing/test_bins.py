"""The packing plans, on lengths alone: bfd places whole examples (an overlong one cut to its first
max_length tokens) with best-fit decreasing, as TRL does; bfd_split places the pieces of overlong examples
the same way; wrapped concatenates in order and cuts every max_length tokens."""

from __future__ import annotations

import random

import pytest

from kiln.engine.data.packing.bins import Piece, best_fit_decreasing, plan


def naive_best_fit(lengths, capacity):
    """Best-fit decreasing by linear scan: longest first (in order among equals), into the open row with the
    least room that holds the piece; among rows with the same room, the one that came to have it first."""
    rows, free, since = [], [], []
    for clock, i in enumerate(sorted(range(len(lengths)), key=lambda i: -lengths[i])):
        fits = [r for r in range(len(rows)) if free[r] >= lengths[i]]
        if fits:
            r = min(fits, key=lambda r: (free[r], since[r]))
        else:
            rows.append([])
            free.append(capacity)
            since.append(0)
            r = len(rows) - 1
        rows[r].append(i)
        free[r] -= lengths[i]
        since[r] = clock
    return rows


def tokens(rows):
    return sorted((p.example, t) for row in rows for p in row for t in range(p.start, p.end))


@pytest.mark.parametrize("seed", range(20))
def test_bfd_is_best_fit_decreasing_and_never_splits_an_example(seed):
    rng = random.Random(seed)
    capacity = rng.choice([5, 8, 16, 33])
    lengths = [rng.randint(1, capacity) for _ in range(rng.randint(1, 60))]
    rows = plan("bfd", lengths, capacity).rows
    assert all(sum(p.length for p in row) <= capacity for row in rows)
    assert tokens(rows) == sorted((i, t) for i, n in enumerate(lengths) for t in range(n))  # every token once
    assert all(p.start == 0 and p.end == lengths[p.example] for row in rows for p in row)
    # the same plan as a linear scan over the rows (the max-tree only makes finding the row O(log capacity))
    assert [[p.example for p in row] for row in rows] == naive_best_fit(lengths, capacity)


def test_bfd_fills_the_fullest_row_that_fits():
    # 6 opens row 0 (room 2), 5 opens row 1 (room 3); 2 goes to row 0 (the tighter fit), 3 to row 1
    assert best_fit_decreasing([Piece(0, 0, 6), Piece(1, 0, 5), Piece(2, 0, 2), Piece(3, 0, 3)], 8) == [
        [Piece(0, 0, 6), Piece(2, 0, 2)],
        [Piece(1, 0, 5), Piece(3, 0, 3)],
    ]
    # equal lengths keep their order; a tie in room goes to the row opened first
    assert best_fit_decreasing([Piece(0, 0, 4), Piece(1, 0, 4), Piece(2, 0, 4)], 8) == [
        [Piece(0, 0, 4), Piece(1, 0, 4)],
        [Piece(2, 0, 4)],
    ]
    assert best_fit_decreasing([Piece(0, 0, 3), Piece(1, 0, 3), Piece(2, 0, 1), Piece(3, 0, 1)], 4) == [
        [Piece(0, 0, 3), Piece(2, 0, 1)],
        [Piece(1, 0, 3), Piece(3, 0, 1)],
    ]


def test_bfd_cuts_an_overlong_example_and_counts_what_it_drops():
    packed = plan("bfd", [10, 3, 12], 8)
    assert (packed.truncated, packed.dropped) == (2, 6)
    assert sorted(p for row in packed.rows for p in row) == [Piece(0, 0, 8), Piece(1, 0, 3), Piece(2, 0, 8)]
    assert plan("bfd", [8, 8], 8)[1:] == (0, 0)  # as long as a row: nothing cut


def test_bfd_split_places_every_piece_of_an_overlong_example():
    packed = plan("bfd_split", [19, 3], 8)
    assert (packed.truncated, packed.dropped) == (0, 0)
    assert sorted(p for row in packed.rows for p in row) == [
        Piece(0, 0, 8),
        Piece(0, 8, 16),
        Piece(0, 16, 19),
        Piece(1, 0, 3),
    ]
    assert all(sum(p.length for p in row) <= 8 for row in packed.rows)


def test_wrapped_concatenates_in_order_and_cuts_every_row():
    assert plan("wrapped", [5, 0, 6, 2, 8], 4).rows == [
        [Piece(0, 0, 4)],
        [Piece(0, 4, 5), Piece(2, 0, 3)],
        [Piece(2, 3, 6), Piece(3, 0, 1)],
        [Piece(3, 1, 2), Piece(4, 0, 3)],
        [Piece(4, 3, 7)],
        [Piece(4, 7, 8)],
    ]
    assert plan("wrapped", [4, 4], 4).rows == [[Piece(0, 0, 4)], [Piece(1, 0, 4)]]


def test_empty_examples_hold_no_token_and_are_left_out():
    assert plan("wrapped", [0, 0], 4).rows == []
    assert plan("bfd", [0, 2, 0], 4).rows == [[Piece(1, 0, 2)]]
    assert plan("bfd_split", [], 4).rows == []


def test_a_capacity_of_one_token():
    assert plan("bfd", [3, 1], 1).rows == [[Piece(0, 0, 1)], [Piece(1, 0, 1)]]
    assert plan("wrapped", [2], 1).rows == [[Piece(0, 0, 1)], [Piece(0, 1, 2)]]
