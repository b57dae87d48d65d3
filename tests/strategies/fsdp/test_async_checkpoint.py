"""`save.async` with FSDP's sharded checkpoints (DCP's async_save), in one 2-process world
(worker_async.py): the step loop goes on while DCP writes the shards, the checkpoint folder appears
only when complete, the run ends bitwise where a synchronous one does, and a kill while the write is
in flight leaves the previous checkpoint as the one a resumed run takes, ending bitwise the same."""

from __future__ import annotations

import pytest
import torch

from kiln.engine.checkpoint.files import is_complete, latest_checkpoint
from kiln.strategies.dcp_files import read_folder
from tests.strategies.fsdp.conftest import torchrun

pytestmark = pytest.mark.distributed


def _equal(a: dict, b: dict) -> None:
    assert set(a) == set(b) and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_async")
    torchrun(2, "worker_async.py", out)
    return out, torch.load(out / "result.pt", weights_only=True)


def test_the_step_loop_goes_on_while_dcp_writes_and_the_folder_appears_when_complete(world):
    out, result = world
    assert result["steps_while_held"] == [7, 8]  # two steps ran while checkpoint-6's write was held
    assert result["visible_while_held"] == [False, False]  # COMPLETE (and the rename) come after DCP's write
    assert result["writers"] == ["AsyncCheckpointExecutor_0"]  # DCP's thread wrote every async shard
    run = out / "async" / "full_shard"
    assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == [
        "checkpoint-3",
        "checkpoint-6",
        "checkpoint-9",
    ]
    assert all(is_complete(str(run / f"checkpoint-{s}")) for s in (3, 6, 9))


def test_an_async_sharded_run_ends_bitwise_like_the_synchronous_one_and_saves_the_same_state(world):
    out, result = world
    _equal(result["async"], result["sync"])
    for step in (6, 9):  # the one held in flight, and the last
        sync = read_folder(str(out / "sync" / "full_shard" / f"checkpoint-{step}"), "fsdp_dcp")
        asynchronous = read_folder(str(out / "async" / "full_shard" / f"checkpoint-{step}"), "fsdp_dcp")
        _equal(sync["model"], asynchronous["model"])
        assert sync["optim"]["param_groups"] == asynchronous["optim"]["param_groups"]
        for name, moments in sync["optim"]["state"].items():
            _equal(moments, asynchronous["optim"]["state"][name])


def test_a_kill_during_the_background_write_resumes_the_previous_checkpoint_bitwise(world):
    out, result = world
    killed = out / "killed" / "full_shard"
    files = result["killed_files"]  # the output folder as it stood while the write was held
    partial = {f.split("/", 1)[1] for f in files if f.startswith(".checkpoint-6.tmp/")}
    assert {"fsdp_dcp/__0_0.distcp", "fsdp_dcp/__1_0.distcp"} <= partial  # both ranks' shards are written,
    assert "fsdp_dcp/.metadata" not in partial and "COMPLETE" not in partial  # DCP's metadata and COMPLETE not
    assert "checkpoint-3/COMPLETE" in files and not any(f.startswith("checkpoint-6/") for f in files)
    assert result["resumed_at"] == 3
    assert latest_checkpoint(str(killed), verify=True) == str(killed / "checkpoint-9")
    _equal(result["resumed"], result["sync"])
