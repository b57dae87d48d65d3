"""`save.async` with FSDP's full-state checkpoints (format `fsdp-full`), in one 2-process world
(worker_async_full.py): the gathers (collectives) run at the step boundary and the files are written by
the background writer, so the step loop goes on while they are written; the folder appears only when
complete; the checkpoints and the final weights are the synchronous run's, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kiln.engine.checkpoint.files import MARKER, is_complete
from tests.strategies.fsdp.conftest import torchrun

pytestmark = pytest.mark.distributed


def test_fsdp_full_saves_in_the_background_and_writes_what_a_synchronous_save_does(tmp_path):
    job = torchrun(2, "worker_async_full.py", tmp_path)
    assert "cannot be written in the background" not in job.stdout + job.stderr
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert result["writers"] == ["kiln-checkpoint-3", "kiln-checkpoint-6", "kiln-checkpoint-9"]  # never the loop
    assert result["steps_while_held"] == [7, 8] and result["visible_while_held"] == [False, False]
    for name, value in result["sync"].items():
        assert torch.equal(value, result["async"][name]), name
    for step in (3, 6, 9):
        sync, asynchronous = (tmp_path / run / "full_shard" / f"checkpoint-{step}" for run in ("sync", "async"))
        assert is_complete(str(asynchronous))
        assert json.loads((asynchronous / MARKER).read_text())["format"] == "fsdp-full"
        want, got = load_file(sync / "model.safetensors"), load_file(asynchronous / "model.safetensors")
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        assert (sync / "optimizer.pt").read_bytes() == (asynchronous / "optimizer.pt").read_bytes()
