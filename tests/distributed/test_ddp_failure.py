"""When one rank raises or dies, every rank exits non-zero within a bounded time, and the first
error is the one reported. Each job runs under a hard timeout, so a hang fails the test."""

from __future__ import annotations

import re
import sys

import pytest

from tests.distributed.conftest import HERE, kiln_cli, run
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


# Without a launcher (a rank SIGKILLed, the survivor must not hang): test_launcher_lifetime.py's
# test_without_an_agent_the_survivor_names_the_rank_that_died, on the same world.
