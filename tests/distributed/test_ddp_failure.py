"""When one rank raises or dies, every rank exits non-zero within a bounded time, and the first
error is the one reported. Each job runs under a hard timeout, so a hang fails the test."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from tests.distributed.conftest import HERE, REPO, kiln_cli, run
from tests.distributed.toy import write_cli_config

pytestmark = pytest.mark.distributed
BOUND = 90  # seconds; a healthy machine needs ~10, a hang would need the 60 s collective timeout or forever


def test_a_raising_rank_stops_kiln_fit_nproc_with_its_error(tmp_path):
    cfg = write_cli_config(str(tmp_path / "c.yaml"), str(tmp_path / "out"), fail_rank=1, fail_step=2)
    proc = kiln_cli("fit", cfg, "--nproc", "2", "max_steps=1000", timeout=BOUND + 30, check=False)
    assert proc.returncode != 0 and proc.elapsed < BOUND
    assert re.search(
        r"kiln: rank 1 failed first \(exit code 2\): error: ValueError: injected failure on rank 1 at step 2 "
        r"\(in on_step_end, ",
        proc.stderr,
    ), proc.stderr[-3000:]


def test_a_killed_rank_stops_the_job_and_is_named(tmp_path):
    """SIGKILL (the OOM killer, an external kill) leaves no Python error behind: the launcher names the
    rank that died rather than the peer whose all-reduce then failed."""
    code = f"import sys; from kiln.launch.local import launch_local; sys.exit(launch_local(2, [{str(HERE / 'worker_fail.py')!r}, {str(tmp_path)!r}]))"
    proc = run([sys.executable, "-c", code], timeout=BOUND + 30, check=False)
    assert proc.returncode != 0 and proc.elapsed < BOUND
    assert "unreachable" not in proc.stdout
    assert "kiln: rank 1 died first (killed by signal 9" in proc.stderr, proc.stderr[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_killed_rank_does_not_hang_its_peer_without_a_launcher(tmp_path):
    """No elastic agent to clean up (e.g. srun without --kill-on-bad-exit): the survivor's collective
    fails as soon as its peer's connection drops."""
    base = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
    }
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "worker_fail.py"), str(tmp_path)],
            cwd=REPO,
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        out0, err0 = procs[0].communicate(timeout=BOUND + 30)
        procs[1].wait(timeout=10)
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == -9
    assert procs[0].returncode != 0 and time.perf_counter() - start < BOUND, err0[-3000:]
    assert "unreachable" not in out0
