"""SIGTERM preemption (`enable_jit_checkpoint` / `save.on_preemption`) on a real 2-process gloo job:
the checkpoint is saved at the next step boundary on every rank, fit() returns on every rank (as HF's
train() does) and the job exits 0, and resuming from
it ends exactly where an uninterrupted run ends. Also: ranks given different output_dirs are refused
at start-up with one sentence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch

from tests.distributed.conftest import HERE, REPO, TORCHRUN
from tests.world import python_path, run_world

pytestmark = pytest.mark.distributed
WORKER = str(HERE / "worker_preempt.py")


def _start(*args: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": python_path(),
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.Popen(
        [*TORCHRUN, WORKER, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _run(*args: str) -> None:
    code, out, err = _finish(_start(*args))
    assert code == 0, f"exit {code}\n{out[-2000:]}\n{err[-4000:]}"


# both ranks signalled is the easier case of one rank signalled: it runs with -m heavy (CI time)
@pytest.mark.parametrize("signalled", ["1", pytest.param("01", marks=pytest.mark.heavy)])
def test_sigterm_saves_on_every_rank_stops_and_resumes_exactly(tmp_path, signalled):
    """`signalled`: which ranks get SIGTERM (one rank alone must still make every rank save)."""
    out = tmp_path / "preempted"
    out.mkdir()
    proc = _start("preempt", str(out), "8", signalled)
    pids = {}
    deadline = time.monotonic() + 150
    while len(pids) < len(signalled) and proc.poll() is None and time.monotonic() < deadline:
        for r in signalled:
            f = out / f"pid{r}"
            if r not in pids and f.exists():
                pids[r] = int(f.read_text())
        time.sleep(0.05)
    assert len(pids) == len(signalled), _finish(proc)
    for pid in pids.values():
        os.kill(pid, signal.SIGTERM)
    code, stdout, stderr = _finish(proc)
    assert code == 0, stderr[-4000:]
    assert "training finished at step 3" in stdout  # fit() returned after the checkpoint, as HF's train() does
    assert "Preempted (SIGTERM): saved checkpoint-3" in stderr
    ckpts = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert ckpts == ["checkpoint-3"]
    done = json.loads((out / "checkpoint-3" / "COMPLETE").read_text())
    assert {"rng_state_0.pth", "rng_state_1.pth", "loop_state_0.pt", "loop_state_1.pt"} <= set(done["files"])

    straight = tmp_path / "straight"
    _run("preempt", str(out), "8", "-", "resume", str(straight))  # then, in the same launch, the uninterrupted run
    a, b = torch.load(straight / "final.pt"), torch.load(out / "final.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "history.json").read_text()) == json.loads((straight / "history.json").read_text())


def test_ranks_with_different_output_dirs_are_refused_at_start(tmp_path):
    proc = run_world(WORKER, "dirs", tmp_path, check=False, timeout=180)
    assert proc.returncode != 0
    assert "output_dir differs between ranks" in proc.stderr, proc.stderr[-4000:]
    assert not any(p.name.startswith("checkpoint-") for d in tmp_path.iterdir() if d.is_dir() for p in d.iterdir())
