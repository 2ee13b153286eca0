#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. This is the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
exec .venv/bin/python -m pytest -q -m "not slow" "$@"
