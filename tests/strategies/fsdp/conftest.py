"""Starting N-process FSDP workers (gloo on CPU), each under a timeout."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.world import run_world

HERE = Path(__file__).resolve().parent


def torchrun(nproc: int, script: str, *args, timeout: float = 600, check: bool = True, env: dict | None = None):
    """`script` on an `nproc`-process world as torchrun starts it (tests/world.py)."""
    return run_world(HERE / script, *args, nproc=nproc, timeout=timeout, check=check, env=env)


#: scenarios that share one 2-process job (worker_many.py); `precision` last: it lets kiln run fp16 on this CPU
SHARED_JOB = ("loading", "generate", "direct", "precision")


@pytest.fixture(scope="session")
def shared_job(tmp_path_factory) -> Path:
    """OUT of one worker_many.py job running every SHARED_JOB scenario; each writes under OUT/<name>/."""
    out = tmp_path_factory.mktemp("fsdp_shared_job")
    torchrun(2, "worker_many.py", out, *SHARED_JOB, timeout=900)
    return out
