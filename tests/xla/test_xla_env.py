"""The XLA tests need torch-xla, which pins its own torch (2.9.1), so they run in a separate
environment (scripts/xla-env.sh). This test, in the main suite, runs them there and reports the
result; inside that environment it has nothing to do."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def xla_python() -> str:
    venv = os.environ.get("KILN_XLA_VENV") or os.path.join(os.path.expanduser("~"), ".cache", "kiln", "xla-venv")
    return os.path.join(venv, "bin", "python")


def wait_for_the_build(timeout: float = 1800.0) -> None:
    """`.ci/run` builds the XLA environment beside the tests and names, in KILN_XLA_READY_FILE, a file it
    touches when the build ends (built or not); the suite runs this test last, so it rarely waits."""
    ready = os.environ.get("KILN_XLA_READY_FILE")
    deadline = time.monotonic() + timeout
    while ready and not os.path.exists(ready):
        if time.monotonic() > deadline:
            pytest.fail(f"the XLA environment's build did not end within {timeout:.0f} s ({ready} never appeared)")
        time.sleep(2.0)


@pytest.mark.slow
def test_xla_suite_passes_in_the_xla_environment():
    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("already inside an XLA environment: pytest runs tests/xla directly")
    wait_for_the_build()
    python = xla_python()
    if not os.path.exists(python):
        pytest.skip(
            f"no XLA environment at {os.path.dirname(os.path.dirname(python))}; build it with: bash scripts/xla-env.sh"
        )
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
    env.pop("CPU_NUM_DEVICES", None)  # the SPMD tests set it for their own subprocesses
    # not the outer run's options: an inner pytest given its --basetemp clears it under the outer workers
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/xla"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    summary = out.strip().splitlines()[-1]
    assert "passed" in summary and "failed" not in summary and "error" not in summary, out[-6000:]
    assert sys.executable != python
