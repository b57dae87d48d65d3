"""Starting N-process FSDP workers (gloo on CPU), each under a timeout."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.distributed.conftest import run

HERE = Path(__file__).resolve().parent


def torchrun(nproc: int, script: str, *args, timeout: float = 600, check: bool = True, env: dict | None = None):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(HERE / script),
        *map(str, args),
    ]
    return run(cmd, timeout=timeout, check=check, env=env)


#: scenarios that share one 2-process job (worker_many.py); `precision` last: it lets kiln run fp16 on this CPU
SHARED_JOB = ("loading", "generate", "direct", "precision")


@pytest.fixture(scope="session")
def shared_job(tmp_path_factory) -> Path:
    """OUT of one worker_many.py job running every SHARED_JOB scenario; each writes under OUT/<name>/."""
    out = tmp_path_factory.mktemp("fsdp_shared_job")
    torchrun(2, "worker_many.py", out, *SHARED_JOB, timeout=900)
    return out
