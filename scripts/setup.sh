#!/usr/bin/env bash
# Create .venv and install kvmesh with its test and NIXL extras on a fresh machine.
# torch goes in first, pinned to the CPU wheel: a bare "torch" requirement in a fresh venv
# would pull a multi-GB CUDA build.
# Then SGLang for the plugin tests (tests/plugins), the CPU recipe of
# ../shared/docs/sglang-interfaces.md §6: sglang without its dependency tree plus the small set
# its imports need, constrained to the CPU torch. Skipped when already installed (a few
# hundred ms), or entirely with KVMESH_SKIP_SGLANG=1 (the plugin tests then skip).
# Never install torchvision: the PyPI wheel drags in a CUDA torch; the tests stub it in memory.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
TORCH_VERSION=${KVMESH_TORCH_VERSION:-2.13.0}
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION}"
.venv/bin/python -m pip install -q -e ".[cu12,test]"

[ "${KVMESH_SKIP_SGLANG:-0}" = 1 ] && exit 0
SGLANG_VERSION=0.5.23
SGLANG_DEPS=(numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec
    pydantic pyzmq tqdm ipython aiohttp "transformers==5.19.0" dill "apache-tvm-ffi==0.1.11"
    "sentencepiece==0.2.1" "compressed-tensors==0.18.0" gguf
    openai partial_json_parser einops prometheus-client)
# Installed = every distribution present at the pinned versions (names as pip spells them).
if ! .venv/bin/python - "$SGLANG_VERSION" "${SGLANG_DEPS[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

want = {"sglang": sys.argv[1]}
for spec in sys.argv[2:]:
    name, _, ver = spec.partition("==")
    want[name] = ver or None
ok = True
for name, ver in want.items():
    try:
        got = version(name)
    except PackageNotFoundError:
        ok = False
        break
    if ver is not None and got != ver:
        ok = False
        break
sys.exit(0 if ok else 1)
PY
then
    echo "setup: installing sglang==${SGLANG_VERSION} (CPU test recipe)" >&2
    constraints=$(mktemp)
    trap 'rm -f "$constraints"' EXIT
    # Pin whatever torch is installed, so that no dependency swaps it for a CUDA build.
    .venv/bin/python -c 'import torch; print("torch==" + torch.__version__)' >"$constraints"
    .venv/bin/python -m pip install -q --no-deps "sglang==${SGLANG_VERSION}"
    .venv/bin/python -m pip install -q -c "$constraints" "${SGLANG_DEPS[@]}"
fi

# SGLang 0.5.14, the older version the plugins support, as an overlay over this environment
# (tests/plugins/test_sglang_0514.py puts it first on PYTHONPATH): sglang and the pins in
# which 0.5.14 differs (sglang-interfaces.md §6: transformers 5.8.1, which needs older
# tokenizers and huggingface_hub, and httpx), all --no-deps, everything else shared.
# The stamp file lists what was installed; a different list reinstalls.
OLD_SGLANG_DIR=.venv/sglang-0.5.14
OLD_SGLANG_PINS=("sglang==0.5.14" "transformers==5.8.1" "tokenizers==0.22.2"
    "huggingface_hub==1.33.0" "httpx==0.28.1" "httpcore==1.0.9")
if [ "$(cat "$OLD_SGLANG_DIR/.kvmesh-pins" 2>/dev/null)" != "${OLD_SGLANG_PINS[*]}" ]; then
    echo "setup: installing the sglang==0.5.14 overlay in $OLD_SGLANG_DIR" >&2
    rm -rf "$OLD_SGLANG_DIR"
    .venv/bin/python -m pip install -q --no-deps --target "$OLD_SGLANG_DIR" "${OLD_SGLANG_PINS[@]}"
    echo "${OLD_SGLANG_PINS[*]}" >"$OLD_SGLANG_DIR/.kvmesh-pins"
fi
