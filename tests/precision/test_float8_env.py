"""precision fp8 and mxfp8 need torchao, which the test extra leaves out: once it is installed, transformers imports it
(and prints its warnings) in every process that builds a model. So where the suite's environment has no
torchao, this test runs the float8 tests with a torchao folder of their own on PYTHONPATH
(scripts/torchao-dir.sh; .ci/run builds it); where torchao is installed, they run directly."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = [
    "tests/precision/test_precision_float8.py",
    "tests/precision/test_precision_mxfp8.py",
    "tests/precision/test_precision_registry.py",
]


def test_float8_tests_pass_with_torchao_on_the_path():
    if importlib.util.find_spec("torchao") is not None:
        pytest.skip("torchao is installed here: the float8 tests run directly")
    folder = os.environ.get("KILN_TORCHAO_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kiln", "torchao")
    if not os.path.isdir(os.path.join(folder, "torchao")):
        pytest.skip(f"no torchao folder at {folder}; make it with: bash scripts/torchao-dir.sh")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, folder])}
    # not the outer run's options: an inner pytest given its --basetemp clears it under the outer workers
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    summary = [line for line in out.splitlines() if " passed" in line][-1]
    assert "failed" not in summary and "skipped" not in summary and "error" not in summary, out[-6000:]
