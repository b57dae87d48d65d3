"""SIGTERM preemption (`enable_jit_checkpoint` / `save.on_preemption`) on a 2-process gloo job (tests/world.py):
the checkpoint is saved at the next step boundary on every rank, fit() returns on every rank (as HF's
train() does) and the job exits 0, and resuming from
it ends exactly where an uninterrupted run ends. Also: ranks given different output_dirs are refused
at start-up with one sentence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest
import torch

from tests.distributed.conftest import HERE
from tests.world import run_world

pytestmark = pytest.mark.distributed
WORKER = str(HERE / "worker_preempt.py")


class _World:
    """A 2-process world of worker_preempt.py forked by tests/world.py, run in a thread so that the test
    can signal its ranks while it trains (the signal goes to a worker, not to a launcher: the launcher's
    own SIGTERM is test_launcher_lifetime.py's)."""

    def __init__(self, *args: str) -> None:
        self.result: list[subprocess.CompletedProcess | BaseException] = []

        def run() -> None:
            try:
                self.result.append(run_world(WORKER, *args, check=False, timeout=180))
            except BaseException as err:  # noqa: BLE001 -- the timeout, raised again in the test's thread
                self.result.append(err)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def running(self) -> bool:
        return self.thread.is_alive()

    def finish(self) -> tuple[int, str, str]:
        self.thread.join()
        proc = self.result[0]
        if isinstance(proc, BaseException):
            raise proc
        return proc.returncode, proc.stdout, proc.stderr


# both ranks signalled is the easier case of one rank signalled: it runs with -m heavy (CI time)
@pytest.mark.parametrize("signalled", ["1", pytest.param("01", marks=pytest.mark.heavy)])
def test_sigterm_saves_on_every_rank_stops_and_resumes_exactly(tmp_path, signalled):
    """`signalled`: which ranks get SIGTERM (one rank alone must still make every rank save)."""
    out = tmp_path / "preempted"
    out.mkdir()
    world = _World("preempt", str(out), "8", signalled)
    pids = {}
    deadline = time.monotonic() + 150
    while len(pids) < len(signalled) and world.running() and time.monotonic() < deadline:
        for r in signalled:
            f = out / f"pid{r}"
            if r not in pids and f.exists():
                pids[r] = int(f.read_text())
        time.sleep(0.05)
    assert len(pids) == len(signalled), world.finish()
    for pid in pids.values():
        os.kill(pid, signal.SIGTERM)
    code, stdout, stderr = world.finish()
    assert code == 0, stderr[-4000:]
    assert "training finished at step 3" in stdout  # fit() returned after the checkpoint, as HF's train() does
    assert "Preempted (SIGTERM): saved checkpoint-3" in stderr
    ckpts = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert ckpts == ["checkpoint-3"]
    done = json.loads((out / "checkpoint-3" / "COMPLETE").read_text())
    assert {"rng_state_0.pth", "rng_state_1.pth", "loop_state_0.pt", "loop_state_1.pt"} <= set(done["files"])

    straight = tmp_path / "straight"
    run_world(
        WORKER, "preempt", str(out), "8", "-", "resume", str(straight), timeout=180
    )  # then, in the same launch, the uninterrupted run
    a, b = torch.load(straight / "final.pt"), torch.load(out / "final.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "history.json").read_text()) == json.loads((straight / "history.json").read_text())


def test_ranks_with_different_output_dirs_are_refused_at_start(tmp_path):
    proc = run_world(WORKER, "dirs", tmp_path, check=False, timeout=180)
    assert proc.returncode != 0
    assert "output_dir differs between ranks" in proc.stderr, proc.stderr[-4000:]
    assert not any(p.name.startswith("checkpoint-") for d in tmp_path.iterdir() if d.is_dir() for p in d.iterdir())
