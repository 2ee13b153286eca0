#!/usr/bin/env bash
# Verify kvmesh's GPU paths on a CUDA machine, in about a minute:
#   * CUDA IPC handles exported in one process and mapped in another,
#   * the cuda_ipc transport (GPU and host memory on the reading side) and, with two GPUs
#     that have peer access, the nvlink transport, all verified byte for byte,
#   * NIXL VRAM registration (a GPU -> host WRITE through UCX),
#   * GPU copy bandwidth (host->device, device->device, device->host),
#   * the SGLang PD drop-in (tests/plugins/test_pd_gpu.py): device and host regions in one
#     batch_register, GPU pages written into another process.
# Then a short report of the GPU(s) and the measured GB/s.
#
# Usage: bash scripts/gpu_check.sh            (from a checkout)
#   KVMESH_PYTHON=/path/to/python  use that interpreter (default: .venv/bin/python, else python3)
# Needs numpy, msgspec, crc32c, pytest and cuda-python (its major version must not exceed the
# driver's CUDA version: cuda-bindings 13 fails with cudaErrorInsufficientDriver on a CUDA 12
# driver); nixl-cu12/nixl-cu13 for the NIXL check (skipped without). Missing packages are
# installed with pip when the machine can reach the package index; offline it says what is
# missing and stops.
set -uo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no working nvidia-smi: this is not a GPU machine" >&2
    exit 2
fi
echo "== GPUs"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -20 || true
driver_cuda=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -1)
echo "driver CUDA major: ${driver_cuda:-unknown}"

PY=${KVMESH_PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
echo "python: $PY ($($PY --version 2>&1))"

pip_install() {
    echo "gpu_check: installing $*" >&2
    timeout 300 "$PY" -m pip install -q "$@" || {
        echo "gpu_check: could not install $* (offline?)" >&2
        return 1
    }
}

missing=()
for mod in numpy msgspec crc32c pytest; do
    "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [ ${#missing[@]} -gt 0 ]; then
    pip_install "${missing[@]}" pytest-timeout || { echo "missing: ${missing[*]}" >&2; exit 3; }
fi

# cuda-python: present, and not newer than the driver.
probe='from kvmesh.transfer import cuda; print(cuda.unavailable_reason() or "ok")'
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
reason=$("$PY" -c "$probe" 2>&1 | tail -1)
if [ "$reason" != "ok" ]; then
    echo "cuda: $reason"
    if [ -n "$driver_cuda" ]; then
        next=$((driver_cuda + 1))
        pip_install "cuda-python>=${driver_cuda}.0,<${next}.0" || true
        reason=$("$PY" -c "$probe" 2>&1 | tail -1)
    fi
    if [ "$reason" != "ok" ]; then
        echo "gpu_check: CUDA is not usable from Python: $reason" >&2
        exit 4
    fi
fi
"$PY" -c "import nixl_cu12" 2>/dev/null || "$PY" -c "import nixl_cu13" 2>/dev/null || \
    pip_install "nixl-cu${driver_cuda:-12}==1.5.1" || echo "gpu_check: NIXL missing: its VRAM test will skip"

echo "== kvmesh GPU tests"
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
timeout 600 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs -s tests/transfer/test_cuda_gpu.py
rc=$?
echo "== SGLang PD drop-in (kvmesh_sglang.pd) on GPU memory"
# KV pages in cudaMalloc memory, aux rows in host memory: batch_register tells the kinds apart
# per pointer, and a request's pages reach another process (cuda_ipc / nvlink) byte for byte.
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs -s tests/plugins/test_pd_gpu.py
rc_pd=$?
echo "== simulated-runtime tests (same logic without a GPU)"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/transfer/test_cuda_ipc.py -k "not unavailable"
rc2=$?
echo "gpu_check: gpu tests rc=$rc, PD drop-in rc=$rc_pd, simulated tests rc=$rc2"
[ $rc -eq 0 ] && [ $rc_pd -eq 0 ] && [ $rc2 -eq 0 ]
