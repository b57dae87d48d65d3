#!/usr/bin/env bash
# Builds (or reuses) the separate virtual environment kiln's XLA tests run in, and prints its python.
# torch-xla pins its own torch (2.9.1 for torch-xla 2.9.0), which the main environment does not have,
# so XLA lives in a venv of its own: ${KILN_XLA_VENV:-$HOME/.cache/kiln/xla-venv}.
# kiln itself is not installed there: the tests put the repository on PYTHONPATH.
set -euo pipefail
VENV="${KILN_XLA_VENV:-$HOME/.cache/kiln/xla-venv}"
PY="$VENV/bin/python"
# What the tests need besides torch/torch-xla: kiln's core dependencies and pytest.
DEPS=(omegaconf safetensors numpy tqdm psutil xxhash pytest pytest-timeout)
CHECK='import torch, torch_xla, omegaconf, safetensors, tqdm, psutil, xxhash, pytest; assert torch.__version__.startswith("2.9.1")'

if [ -x "$PY" ] && "$PY" -c "$CHECK" >/dev/null 2>&1; then
    echo "$PY"
    exit 0
fi
BASE_PY="${KILN_XLA_BASE_PYTHON:-$(command -v python3 || command -v python)}"
[ -x "$PY" ] || "$BASE_PY" -m venv "$VENV" >&2
"$PY" -m pip install -q torch==2.9.1 torch-xla==2.9.0 "${DEPS[@]}" >&2
"$PY" -c "$CHECK" >&2
echo "$PY"
