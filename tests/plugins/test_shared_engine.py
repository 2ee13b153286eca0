"""One transfer engine per process, shared by the PD drop-in and the HiCache backend (issue 9).

In this one process: SGLang's plugin loader swaps the Mooncake engine and SGLang's own
``init_mooncake_transfer_engine`` builds the kvmesh drop-in (the PD path); a
``KvmeshHiCacheStorage`` over a real SGLang host pool attaches to an embedded store (the
HiCache path). Both must sit on the one ``kvmesh.transfer.get_engine()``: one engine object,
one region table holding the PD pool and the host pool (each registered once), and both
paths moving bytes through it in the same process -- a PD ``batch_transfer_sync`` into a
decode process (checked byte for byte there) and a HiCache ``batch_set_v1``/``batch_get_v1``
round trip (checked byte for byte here), each counted by the engine.

The plant (a backend that makes its own engine) shows the checks catch a second engine.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from .sglang_env import ROOT, sglang_missing

_why = sglang_missing()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")

if _why is None:
    import torch

    from bench._common import Child
    from bench._pd import KVPool, geometry_argv
    from kvmesh.transfer import TransferEngine, get_engine
    from kvmesh_sglang import hicache as H
    from kvmesh_sglang import pd as kpd

    from .hicache_util import build_pool, fill_pages, page_digests, page_keys, storage_config
    from .pd_harness import load_plugin_via_sglang

GEOM = {"layers": 2, "pages": 16, "page_size": 8, "heads": 2, "head_dim": 16}
PAGES = 8  # HiCache pages per round trip


@pytest.fixture(scope="module")
def decode():
    argv = [sys.executable, "-m", "bench._pd", *geometry_argv(**GEOM)]
    child = Child(argv, timeout=60, cwd=str(ROOT))
    yield child
    child.close()


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """The PD drop-in as SGLang builds it, with a registered KV pool (as its manager does)."""
    mte = load_plugin_via_sglang(tmp_path_factory.mktemp("eps"))
    eng = mte.init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    assert isinstance(eng, kpd.KvmeshTransferEngine)
    pool = KVPool(**GEOM)
    pool.fill(seed=23)
    assert pool.register(eng) == 0
    yield eng, pool
    assert eng.batch_deregister(pool.kv_data_ptrs + pool.aux_data_ptrs) == 0


def make_backend(namespace: str) -> tuple[Any, Any]:
    """A HiCache backend (embedded store, this process) over a real MHA host pool."""
    pool = build_pool(
        "mha", "page_first", layers=2, heads=2, head_dim=16, page_size=16, device_tokens=512
    )
    backend = H.KvmeshHiCacheStorage(
        storage_config(extra={"namespace": namespace, "segment_size": 16 << 20}), {}
    )
    backend.register_mem_pool_host(pool)
    backend.register_mem_pool_host(pool)  # SGLang may hand it again: still one registration
    return backend, pool


def spans(engine: Any) -> list[tuple[int, int]]:
    return [(r.ptr, r.size) for r in engine.regions()]


def host_pool_regions(table: list[tuple[int, int]], pool: Any) -> list[tuple[int, int]]:
    """The regions of ``table`` inside the host pool's buffer, checked to cover it exactly
    once (SGLang's pools hand K and V halves as separate buffers: several regions, no
    overlap, no gap, no duplicate)."""
    lo = pool.kv_buffer.data_ptr()
    hi = lo + pool.kv_buffer.numel() * pool.kv_buffer.element_size()
    inside = sorted(s for s in table if lo <= s[0] < hi)
    end = lo
    for ptr, size in inside:
        assert ptr == end, f"host pool registered twice or with a gap at {ptr:#x}"
        end = ptr + size
    assert not inside or end == hi, "the host pool is only partly registered"
    return inside


def check_one_engine(pd_eng: Any, pd_pool: Any, backend: Any, host_pool: Any) -> Any:
    """The checks of the issue: one engine object, one region table with both users' memory."""
    engine = pd_eng.get_engine()
    assert engine is get_engine(), "the PD drop-in is not on the process-wide engine"
    assert backend.client.engine is engine, "the HiCache backend has an engine of its own"
    table = spans(engine)
    assert host_pool_regions(table, host_pool), "the host pool is not in the shared engine"
    for ptr, length in zip(
        pd_pool.kv_data_ptrs + pd_pool.aux_data_ptrs, pd_pool.kv_data_lens + pd_pool.aux_data_lens
    ):
        assert table.count((ptr, length)) == 1, "a PD buffer is missing from the shared table"
    return engine


def pd_write(pd_eng: Any, pool: Any, child: Any, src: list[int], dst: list[int]) -> None:
    """One ``batch_transfer_sync``: pages ``src`` of every K and V buffer to pages ``dst``."""
    s, d, n = [], [], []
    for sp, dp in zip(pool.kv_data_ptrs, child.info["kv_data_ptrs"]):
        for a, b in zip(src, dst):
            s.append(sp + a * pool.item_len)
            d.append(dp + b * pool.item_len)
            n.append(pool.item_len)
    assert pd_eng.batch_transfer_sync(child.info["session_id"], s, d, n) == 0
    assert child.call("digest", pages=dst)["digest"] == pool.page_digest(src)


def hicache_round_trip(backend: Any, pool: Any, salt: str) -> None:
    """Set pages, then read them back into other slots of the same host pool."""
    keys = page_keys(PAGES, salt)
    src = pool.alloc(PAGES * pool.page_size)
    dst = pool.alloc(PAGES * pool.page_size)
    fill_pages(pool, src, [1000 + i for i in range(PAGES)])
    fill_pages(pool, dst, [0] * PAGES)
    assert backend.batch_set_v1(keys, src) == [True] * PAGES
    assert backend.batch_exists(keys) == PAGES
    assert backend.batch_get_v1(keys, dst) == [True] * PAGES
    assert page_digests(pool, dst, PAGES) == page_digests(pool, src, PAGES)
    pool.free(torch.cat([src, dst]))


def moved(stats: dict[str, Any]) -> int:
    return sum(v[1] for v in stats.values())


def test_pd_and_hicache_share_one_engine_and_both_move_bytes(pd, decode):
    pd_eng, pd_pool = pd
    decode.call("zero")
    backend, host_pool = make_backend("shared-engine")
    try:
        engine = check_one_engine(pd_eng, pd_pool, backend, host_pool)
        batches0 = engine.info()["batches"]
        pd0 = dict(pd_eng.stats["by_transport"])
        store0 = moved(backend.client.stats)

        # Interleaved, from the same process: PD write, HiCache round trip, PD write.
        pd_write(pd_eng, pd_pool, decode, [1, 2, 3], [9, 4, 12])
        after_pd = engine.info()["batches"]
        assert after_pd > batches0, "the PD write did not go through the shared engine"
        hicache_round_trip(backend, host_pool, "shared-a")
        after_hc = engine.info()["batches"]
        assert after_hc > after_pd, "the HiCache transfers did not go through the shared engine"
        pd_write(pd_eng, pd_pool, decode, [5, 0], [1, 15])
        assert engine.info()["batches"] > after_hc

        # Per-transport views of the two users of the engine, both with traffic.
        pd_bytes = {k: v - pd0.get(k, 0) for k, v in pd_eng.stats["by_transport"].items()}
        assert sum(pd_bytes.values()) == 5 * 2 * GEOM["layers"] * pd_pool.item_len
        assert any(v > 0 for v in pd_bytes.values()) and "none" not in pd_bytes
        page = host_pool.get_dummy_flat_data_page()
        store_bytes = moved(backend.client.stats) - store0
        assert store_bytes == 2 * PAGES * page.numel() * page.element_size()  # set + get
        assert any(k.startswith("write:") for k in backend.client.stats)
        assert any(k.startswith("read:") for k in backend.client.stats)
        # Still one engine and one registration of the host pool after all that traffic.
        assert check_one_engine(pd_eng, pd_pool, backend, host_pool) is engine
    finally:
        backend.close()


def test_a_backend_with_its_own_engine_is_caught(pd, monkeypatch):
    """Plant: the backend builds a private engine instead of the shared one."""
    pd_eng, pd_pool = pd
    own = TransferEngine(listen="127.0.0.1:0")
    monkeypatch.setattr(H, "get_engine", lambda: own)
    backend, host_pool = make_backend("shared-engine-plant")
    try:
        hicache_round_trip(backend, host_pool, "plant")  # it works on its own engine...
        with pytest.raises(AssertionError, match="engine of its own"):
            check_one_engine(pd_eng, pd_pool, backend, host_pool)  # ...but is caught
        # Even without the identity check, the shared region table does not hold the pool.
        assert not host_pool_regions(spans(get_engine()), host_pool)
        assert host_pool_regions(spans(own), host_pool)
    finally:
        backend.close()
        own.close()
