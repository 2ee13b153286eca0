"""The PD drop-in with GPU memory (KV on the device, aux rows on the host, as in SGLang).

Needs CUDA through cuda-python (``kvmesh.transfer.cuda``); skipped cleanly elsewhere.
``bash scripts/gpu_check.sh`` runs these on a GPU machine. SGLang itself is not needed: the
class is the one the plugin hands to SGLang (tests/plugins/test_pd_plugin.py shows that).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kvmesh.transfer import MemoryKind, cuda, get_engine

from .sglang_env import ROOT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda.available(), reason=f"no CUDA: {cuda.unavailable_reason()}"),
]

GEOM = {"layers": 2, "pages": 32, "page_size": 16, "heads": 2, "head_dim": 64}


def test_batch_register_tells_device_from_host_memory():
    from bench._pd import KVPool
    from kvmesh.transfer import memory_kind
    from kvmesh_sglang.pd import KvmeshTransferEngine

    pool = KVPool(**GEOM, device="cuda")
    try:
        eng = KvmeshTransferEngine("127.0.0.1", 0, None)
        for p in pool.kv_data_ptrs:
            assert memory_kind(p)[0] is MemoryKind.VRAM
        for p in pool.aux_data_ptrs:
            assert memory_kind(p) == (MemoryKind.DRAM, -1)
        assert pool.register(eng) == 0  # one call, device and host regions mixed
        kinds = {r.ptr: r.kind for r in get_engine().regions()}
        assert all(kinds[p] is MemoryKind.VRAM for p in pool.kv_data_ptrs)
        assert all(kinds[p] is not MemoryKind.VRAM for p in pool.aux_data_ptrs)
        assert eng.batch_deregister(pool.kv_data_ptrs + pool.aux_data_ptrs) == 0
    finally:
        pool.close()


def test_gpu_pages_to_another_process():
    from bench._common import Child
    from bench._pd import KVPool, geometry_argv
    from kvmesh_sglang.pd import KvmeshTransferEngine

    pool = KVPool(**GEOM, device="cuda")
    pool.fill(seed=4)
    eng = KvmeshTransferEngine("127.0.0.1", 0, None)
    assert pool.register(eng) == 0
    child = Child(
        [sys.executable, "-m", "bench._pd", *geometry_argv(**GEOM, device="cuda")],
        timeout=120,
        cwd=str(ROOT),
    )
    try:
        src = np.array([1, 2, 3, 7, 20])
        dst = np.array([0, 1, 2, 30, 31])
        item = pool.item_len
        blocks = [
            (s + int(a) * item, d + int(b) * item, item)
            for s, d in zip(pool.kv_data_ptrs, child.info["kv_data_ptrs"])
            for a, b in zip(src, dst)
        ]
        # The aux row goes from host memory to the peer's host memory in the same batch.
        aux = (pool.aux_data_ptrs[0] + 64 * 3, child.info["aux_data_ptrs"][0] + 64 * 5, 64)
        s, d, n = (list(x) for x in zip(*blocks, aux))
        before = dict(eng.stats["by_transport"])
        assert eng.batch_transfer_sync(child.info["session_id"], s, d, n) == 0
        assert child.call("digest", pages=dst.tolist())["digest"] == pool.page_digest(src)
        used = {k for k, v in eng.stats["by_transport"].items() if v != before.get(k, 0)}
        assert used & {"cuda_ipc", "nvlink", "nixl"}, used
    finally:
        child.close()
        eng.batch_deregister(pool.kv_data_ptrs + pool.aux_data_ptrs)
        pool.close()
