"""Starting N-process FSDP workers (gloo on CPU), each under a timeout."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.distributed.conftest import run

HERE = Path(__file__).resolve().parent


def torchrun(nproc: int, script: str, *args, timeout: float = 600, check: bool = True, env: dict | None = None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(HERE / script),
           *map(str, args)]
    return run(cmd, timeout=timeout, check=check, env=env)
