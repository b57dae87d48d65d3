#!/usr/bin/env bash
# Installs torchao (precision: fp8) into a folder of its own and prints it: the float8 tests run with it on
# PYTHONPATH (tests/precision/test_float8_env.py). It is kept out of the main test environment because
# transformers imports torchao, with its warnings, into every process that builds a model once it is installed.
set -euo pipefail
DIR="${KILN_TORCHAO_DIR:-$HOME/.cache/kiln/torchao}"
if ! PYTHONPATH="$DIR" python -c "import torchao.float8" >/dev/null 2>&1; then
  python -m pip install -q --no-deps --upgrade --target "$DIR" "torchao>=0.18,<0.19" >&2
fi
echo "$DIR"
