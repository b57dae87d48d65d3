#!/usr/bin/env bash
# Lint, format check and type check, as CI runs them (.ci/run). Settings live in pyproject.toml
# ([tool.ruff], [tool.mypy]); ruff and mypy come with the `test` extra.
#   bash scripts/lint.sh          check only (what CI runs)
#   bash scripts/lint.sh --fix    apply ruff's safe fixes and format first, then check
set -euo pipefail
cd "$(dirname "$0")/.."
PATHS=(kiln tests bench scripts examples)
if [[ "${1:-}" == "--fix" ]]; then
  ruff check --fix "${PATHS[@]}"
  ruff format "${PATHS[@]}"
fi
status=0
ruff check "${PATHS[@]}" || status=1
ruff format --check "${PATHS[@]}" || status=1
mypy || status=1  # the files to check are [tool.mypy] packages (kiln)
exit "$status"
