"""auto_find_batch_size under DDP: when one rank runs out of memory every rank shrinks together (no
hang), and the run ends exactly where a DDP run configured with the found size ends."""

from __future__ import annotations

import json

import pytest

from tests.distributed.conftest import torchrun

pytestmark = pytest.mark.distributed


def test_ranks_agree_on_the_size_and_match_a_configured_run(tmp_path):
    torchrun("worker_auto_batch.py", tmp_path, timeout=120)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["sizes"] == [5, 5]  # 8 -> 7 -> 6 -> 5 on both ranks, though only rank 1 ran out
    assert results["equal"]
