"""A checkpoint is published (COMPLETE written, folder renamed into place) only after every rank has
written its own files. Ranks on one CPU finish their writes at nearly the same moment, so a missing
wait between "all ranks wrote" and "rank 0 seals" passes every resume test; here rank 1 is made slow
(worker_slow_rank_save.py) and the published checkpoints are checked file by file."""

from __future__ import annotations

import json

import pytest

from tests.distributed.conftest import torchrun

pytestmark = pytest.mark.distributed

PER_RANK = {"rng_state_0.pth", "rng_state_1.pth", "loop_state_0.pt", "loop_state_1.pt"}


def test_the_published_checkpoint_holds_and_lists_every_ranks_files(tmp_path):
    torchrun("worker_slow_rank_save.py", tmp_path, timeout=300)
    # rank 1 found the temporary folder in place for its whole (bounded) wait, at both saves
    assert json.loads((tmp_path / "rank1_saves.json").read_text()) == [{"tmp_seen": True, "tmp_vanished": False}] * 2
    for step in (2, 4):
        ckpt = tmp_path / "run" / f"checkpoint-{step}"
        on_disk = {p.name for p in ckpt.iterdir()}
        listed = set(json.loads((ckpt / "COMPLETE").read_text())["files"])
        assert PER_RANK <= on_disk, step
        assert PER_RANK <= listed, step
        assert listed == on_disk - {"COMPLETE"}, step
    assert not list((tmp_path / "run").glob(".checkpoint-*"))  # no temporary folder left behind
