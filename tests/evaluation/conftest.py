"""One intra-op thread for the evaluation tests: their models are tiny, and on a busy 2-core machine a
second OpenMP thread only adds spin-waits (a tiny generate() call is ~10x slower with two)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
