"""SIGKILL of a 2-process FSDP job while it writes a sharded checkpoint (blocked there by a hook in the
worker, so the kill lands inside the save every time): the half-written folder has no COMPLETE marker
and is not taken, `resume_from_checkpoint=true` resumes from the previous complete checkpoint, whose
files are untouched, and the resumed run ends bitwise where an uninterrupted run ends."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.conftest import REPO
from tests.strategies.fsdp.conftest import HERE, torchrun
from tests.world import python_path

pytestmark = pytest.mark.distributed


def _digests(folder) -> dict:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_kill_during_a_sharded_save_resumes_from_the_previous_checkpoint_exactly(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": python_path(),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(HERE / "worker_kill.py"),
        str(tmp_path),
        "kill",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "blocked").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "blocked").exists(), (
            proc.communicate(timeout=30)[1][-4000:] if proc.poll() is not None else "timeout"
        )
    finally:  # the workers run in sessions of their own (torchrun's agent starts them so)
        for rank in (0, 1):
            if (tmp_path / f"pid{rank}").exists():
                os.kill(int((tmp_path / f"pid{rank}").read_text()), signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    run = tmp_path / "run" / "full_shard"  # cases.config puts each case in a folder of its name
    names = sorted(p.name for p in run.iterdir() if "checkpoint" in p.name)
    assert names == [".checkpoint-4.tmp", "checkpoint-2"]
    partial = run / ".checkpoint-4.tmp"
    # killed inside DCP: both shards are on disk, DCP's metadata and kiln's marker are not
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(partial / "fsdp_dcp"))
    assert not (partial / "fsdp_dcp" / ".metadata").exists() and not (partial / "COMPLETE").exists()
    saved = _digests(run / "checkpoint-2")
    assert "COMPLETE" in saved

    torchrun(2, "worker_kill.py", tmp_path, "resume")
    assert (tmp_path / "resumed_at").read_text() == "2"
    assert _digests(run / "checkpoint-2") == saved  # nothing already saved was lost or rewritten
    assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
    ]
    got, want = load_file(str(tmp_path / "resumed.safetensors")), load_file(str(tmp_path / "straight.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
