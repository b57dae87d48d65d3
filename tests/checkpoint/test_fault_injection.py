"""A real training process killed with SIGKILL at random moments, many times, some of them inside a
checkpoint write: every restart resumes from the newest complete checkpoint, no half-written folder is
ever visible under a checkpoint name, and the run ends bit-identical to one that never stopped."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from kiln.engine.checkpoint.files import is_complete, latest_checkpoint, list_checkpoints
from tests.checkpoint.crash_worker import CONFIG

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_worker.py")
KILLS = 10
KINDS = ("training", "write", "setup", "write", "training", "write")


class Worker:
    """Drives a crash worker script (`crash_worker.py`, `async_crash_worker.py`) over its stdin/stdout."""

    def __init__(self, script: str = WORKER) -> None:
        self.proc = subprocess.Popen([sys.executable, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._read() == "ready"

    def _read(self) -> str:
        line = self.proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert line, "the crash worker died"
        return line

    def start(self, out: str, result: str, *args: object) -> int:
        self.proc.stdin.write(" ".join(map(str, ("run", out, result, *args))) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return int(self._read().split()[1])

    def wait(self) -> int:
        return int(self._read().split()[1])

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait(timeout=30)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it finished first; the worker reports exit 0
        pass


def _tmp_folders(out: str, since: float) -> set[str]:
    """Checkpoint writes (`.tmp` folders) begun after `since`, in progress or cut off."""
    if not os.path.isdir(out):
        return set()
    found = set()
    for name in os.listdir(out):
        try:
            if name.endswith(".tmp") and os.stat(os.path.join(out, name)).st_mtime >= since:
                found.add(name)
        except FileNotFoundError:  # renamed into place meanwhile
            pass
    return found


def _wait_for(predicate, deadline: float) -> None:  # type: ignore[no-untyped-def]
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.0005)


def _kill_at_random_moment(kind: str, run_dir: str, out: str, pid: int, rng: random.Random, max_writes: int) -> None:
    """`setup`: any time in the first 0.3 s (importing, building, loading); `training`: up to 0.6 s
    after training began; `write`: a few milliseconds into the 1st .. `max_writes`-th checkpoint write."""
    deadline = time.monotonic() + 10
    if kind == "setup":
        time.sleep(rng.uniform(0, 0.3))
    else:
        _wait_for(lambda: os.path.exists(os.path.join(run_dir, f"began-{pid}")), deadline)
        if kind == "training":
            time.sleep(rng.uniform(0, 0.6))
        else:
            since, seen, target = time.time() - 0.01, set(), rng.randint(1, max_writes)
            while len(seen) < target and time.monotonic() < deadline:
                seen |= _tmp_folders(out, since)
                time.sleep(0.0005)
            time.sleep(rng.uniform(0, 0.008))
    _kill(pid)


def _plan(kills: int, latest: str | None, rng: random.Random) -> tuple[str, int]:
    """The next kill's kind, throttled near the end so that the run cannot finish before KILLS kills
    however fast the machine is (a kill inside the n-th write keeps at most n - 1 new checkpoints)."""
    step = int(latest.rsplit("-", 1)[1]) if latest else 0
    saves_left = (CONFIG["max_steps"] - step) // CONFIG["save_steps"]
    slack = saves_left - (KILLS - kills)
    kind = KINDS[kills % len(KINDS)]
    if slack <= 4 and kind == "training":
        kind = "write"
    return kind, max(1, min(3, slack))


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the worker forks its training processes (POSIX)")
def test_sigkill_at_random_moments_resumes_bit_identically(tmp_path):
    seed = int(os.environ.get("KILN_CRASH_SEED", "1234"))
    rng = random.Random(seed)
    worker = Worker()
    try:
        ref_out, ref_result = str(tmp_path / "ref" / "out"), str(tmp_path / "ref.pt")
        os.makedirs(os.path.dirname(ref_out))
        worker.start(ref_out, ref_result)
        assert worker.wait() == 0
        run_dir = tmp_path / "killed"
        run_dir.mkdir()
        out, result = str(run_dir / "out"), str(tmp_path / "killed.pt")
        expected: dict[int, str] = {}
        kills = mid_write = 0
        while True:
            latest = latest_checkpoint(out)
            started = time.time() - 0.01
            pid = worker.start(out, result)
            expected[pid] = os.path.basename(latest) if latest else "fresh"
            if kills == KILLS:
                assert worker.wait() == 0, f"the final, unkilled run failed (seed {seed})"
                break
            kind, max_writes = _plan(kills, latest, rng)
            _kill_at_random_moment(kind, str(run_dir), out, pid, rng, max_writes)
            during_write = bool(_tmp_folders(out, started))
            status = worker.wait()
            print(f"  run from {expected[pid]}: {time.time() - started:.2f}s, status {status}, write {during_write}")
            if status == 0:  # finished before the kill landed
                break
            assert status == -signal.SIGKILL
            kills += 1
            mid_write += during_write
            # Invariant after every kill: anything named checkpoint-<step> is complete.
            for _, path in list_checkpoints(out):
                assert is_complete(path), f"{path} is visible but incomplete after a kill (seed {seed})"
    finally:
        worker.close()

    print(f"{kills} kills, {mid_write} inside a checkpoint write (seed {seed})")
    assert kills >= 8, f"only {kills} kills landed before the run finished (seed {seed})"
    assert mid_write >= 3, f"only {mid_write} kills landed inside a checkpoint write (seed {seed})"
    logged = dict(line.split() for line in (run_dir / "resumes.log").read_text().splitlines())
    for pid, name in logged.items():
        assert name == expected[int(pid)], f"process {pid} resumed from {name}, expected {expected[int(pid)]}"
    assert sum(name != "fresh" for name in logged.values()) >= 4  # most restarts really resumed

    ref, got = torch.load(ref_result, weights_only=True), torch.load(result, weights_only=True)
    assert ref["weights"].keys() == got["weights"].keys()
    for name in ref["weights"]:
        assert torch.equal(ref["weights"][name], got["weights"][name]), name
    assert ref["history"] == got["history"]
