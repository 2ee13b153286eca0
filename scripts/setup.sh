#!/usr/bin/env bash
# Create .venv and install kvmesh with its test and NIXL extras on a fresh machine.
# torch goes in first, pinned to the CPU wheel: a bare "torch" requirement in a fresh venv
# would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==${KVMESH_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[cu12,test]"
