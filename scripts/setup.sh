#!/usr/bin/env bash
# Create .venv and install kvmesh with its test and NIXL extras on a fresh machine.
# torch goes in first, pinned to the CPU wheel: a bare "torch" requirement in a fresh venv
# would pull a multi-GB CUDA build.
# Then SGLang for the plugin tests (tests/plugins), the CPU recipe of
# ../shared/docs/sglang-interfaces.md §6: sglang without its dependency tree plus the small set
# its imports need, constrained to the CPU torch. Skipped when already installed (a few
# hundred ms), or entirely with KVMESH_SKIP_SGLANG=1 (the plugin tests then skip).
# Never install torchvision: the PyPI wheel drags in a CUDA torch; the tests stub it in memory.
# LMCache the same way, for its Mooncake connector's test (KVMESH_SKIP_LMCACHE=1 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
TORCH_VERSION=${KVMESH_TORCH_VERSION:-2.13.0}
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION}"
.venv/bin/python -m pip install -q -e ".[cu12,test]"

# have_pins SPEC...: every distribution named is installed, at the version where a spec says
# name==version (names as pip spells them).
have_pins() {
    .venv/bin/python - "$@" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

for spec in sys.argv[1:]:
    name, _, ver = spec.partition("==")
    try:
        got = version(name)
    except PackageNotFoundError:
        sys.exit(1)
    if ver and got != ver:
        sys.exit(1)
PY
}
# Pin whatever torch is installed, so that no dependency below swaps it for a CUDA build.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
.venv/bin/python -c 'from importlib.metadata import version; print("torch==" + version("torch"))' \
    >"$constraints"
TRANSFORMERS_PIN="transformers==5.19.0"

# LMCache 0.5.6 for tests/plugins/test_lmcache_connector.py (its Mooncake connector on
# kvmesh.store.compat): the wheel without its dependency tree (cupy, cuda-python, cufile and
# nvtx among it) plus what its storage path imports; the test stands in for numba (imported
# by its cachegen kernels only). Skipped when installed, or with KVMESH_SKIP_LMCACHE=1 (the
# test then skips).
LMCACHE_VERSION=0.5.6
LMCACHE_DEPS=(pyyaml requests cachetools sortedcontainers py-cpuinfo psutil aiohttp aiofile
    aiofiles pyzmq cryptography prometheus-client "$TRANSFORMERS_PIN")
if [ "${KVMESH_SKIP_LMCACHE:-0}" != 1 ] &&
    ! have_pins "lmcache==${LMCACHE_VERSION}" "${LMCACHE_DEPS[@]}"; then
    echo "setup: installing lmcache==${LMCACHE_VERSION} (CPU test recipe)" >&2
    .venv/bin/python -m pip install -q --no-deps "lmcache==${LMCACHE_VERSION}"
    .venv/bin/python -m pip install -q -c "$constraints" "${LMCACHE_DEPS[@]}"
fi

[ "${KVMESH_SKIP_SGLANG:-0}" = 1 ] && exit 0
SGLANG_VERSION=0.5.23
SGLANG_DEPS=(numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec
    pydantic pyzmq tqdm ipython aiohttp "$TRANSFORMERS_PIN" dill "apache-tvm-ffi==0.1.11"
    "sentencepiece==0.2.1" "compressed-tensors==0.18.0" gguf
    openai partial_json_parser einops prometheus-client)
if ! have_pins "sglang==${SGLANG_VERSION}" "${SGLANG_DEPS[@]}"; then
    echo "setup: installing sglang==${SGLANG_VERSION} (CPU test recipe)" >&2
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
