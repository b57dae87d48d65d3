"""The benches' process harness: each run in a fresh interpreter, import timings, and kiln's bytecode
written first as an installed package has it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))


def run_worker(
    script: str, argv: list[str], env: dict[str, str], what: str, timeout: float | None = None
) -> dict[str, Any]:
    """`script argv --launched NOW` in a fresh interpreter; the JSON of the last `RESULT ` line it prints."""
    launched = time.time()
    try:
        proc = subprocess.run(
            [sys.executable, script, *argv, "--launched", repr(launched)],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{what} did not finish within {timeout:.0f} s") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def each_in_a_fresh_process(script: str, variants: Any, argv: list[str]) -> dict[str, dict[str, Any]]:
    """`script --variant V argv` for each variant, one fresh interpreter each (its peak memory its own); the
    JSON of the last line each prints, by variant."""
    rows = {}
    for variant in variants:
        out = subprocess.run(
            [sys.executable, script, "--variant", variant, *argv], check=True, capture_output=True, text=True
        ).stdout
        rows[variant] = json.loads(out.strip().splitlines()[-1])
        print(f"{variant}: {rows[variant]}", file=sys.stderr, flush=True)
    return rows


def import_time(stmt: str) -> float:
    code = f"import time; t = time.perf_counter(); {stmt}; print(time.perf_counter() - t)"
    env = {**os.environ, "PYTHONPATH": os.path.dirname(BENCH)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


def compile_sources() -> None:
    """Write kiln's bytecode (and this folder's) before any run, as `pip install` does for an installed
    package. Where PYTHONDONTWRITEBYTECODE is set (containers often set it), an editable kiln would
    otherwise compile every module from source at each start (about 45 ms here), which HF Trainer and
    Lightning, installed from wheels with their bytecode, never do."""
    import compileall

    import kiln

    for folder in (os.path.dirname(os.path.abspath(kiln.__file__)), BENCH):
        compileall.compile_dir(folder, quiet=1)
