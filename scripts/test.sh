#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. This is the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Lint and format are part of the test (ruff config in pyproject.toml); only when no pytest
# arguments narrow the run, so a developer can still run one test file quickly.
if [ $# -eq 0 ]; then
    .venv/bin/ruff check --quiet .
    .venv/bin/ruff format --check --quiet .
fi
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
exec .venv/bin/python -m pytest -q -m "not slow" "$@"
