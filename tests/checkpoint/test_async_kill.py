"""SIGKILL at 20 points inside asynchronous checkpoint writes (`save.async_save`): before the weights,
before the optimizer file, before each fsync, before the marker, before the rename, during rotation.
After every kill the previous checkpoint is intact, nothing named checkpoint-<step> is incomplete, the
next run resumes from the newest intact checkpoint, and the run ends bit-identical to one that never
stopped."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from kiln.engine.checkpoint.files import is_complete, latest_checkpoint, list_checkpoints
from tests.checkpoint.test_fault_injection import Worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "async_crash_worker.py")
#: the first run dies late (a checkpoint or two are complete by then), so every later one resumes
KILL_POINTS = [20, *range(1, 20)]


def _run(worker: Worker, out: str, result: str, kill_at: int) -> tuple[int, int]:
    pid = worker.start(out, result, kill_at)
    return pid, worker.wait()


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the worker forks its training processes (POSIX)")
def test_sigkill_at_20_points_of_background_writes_resumes_bit_identically(tmp_path):
    worker = Worker(WORKER)
    try:
        ref_result = str(tmp_path / "ref.pt")
        _, status = _run(worker, str(tmp_path / "ref" / "out"), ref_result, 0)
        assert status == 0
        run_dir = tmp_path / "killed"
        run_dir.mkdir()
        out, result = str(run_dir / "out"), str(tmp_path / "killed.pt")
        expected: dict[int, str] = {}
        for kill_at in KILL_POINTS:
            before = latest_checkpoint(out, verify=True)
            pid, status = _run(worker, out, result, kill_at)
            expected[pid] = os.path.basename(before) if before else "fresh"
            assert status == -signal.SIGKILL, f"kill point {kill_at}: the run was not killed (status {status})"
            for _, path in list_checkpoints(out):  # anything named checkpoint-<step> is complete
                assert is_complete(path), f"kill point {kill_at}: {path} is visible but incomplete"
            after = latest_checkpoint(out, verify=True)  # intact: checksums and all
            if before is not None:
                assert after is not None and int(after.rsplit("-", 1)[1]) >= int(before.rsplit("-", 1)[1]), kill_at
        last = latest_checkpoint(out, verify=True)
        pid, status = _run(worker, out, result, 0)
        expected[pid] = os.path.basename(last) if last else "fresh"
        assert status == 0
    finally:
        worker.close()

    logged = dict(line.split() for line in (run_dir / "resumes.log").read_text().splitlines())
    assert logged == {str(pid): name for pid, name in expected.items()}  # each run resumed the newest intact one
    assert sum(name != "fresh" for name in logged.values()) == len(KILL_POINTS)
    ref, got = torch.load(ref_result, weights_only=True), torch.load(result, weights_only=True)
    for name in ref["weights"]:
        assert torch.equal(ref["weights"][name], got["weights"][name]), name
    assert ref["history"] == got["history"]
