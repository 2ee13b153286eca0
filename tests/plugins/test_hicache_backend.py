"""kvmesh as SGLang's HiCache L3 tier, driven with SGLang's real classes on CPU: host pools
(MHA and MLA, every layout), ``HiCacheStorageConfig``, ``StorageBackendFactory`` (dynamic),
``PoolTransfer`` (v2) and ``StorageMetrics``; a store master process; a second process as
another SGLang instance. The store restart test runs last (it empties the master)."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
import threading
import time

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/setup.sh)", allow_module_level=True)

import torch  # noqa: E402

from kvmesh import StoreClient  # noqa: E402
from kvmesh.store.cluster import StoreCluster  # noqa: E402

from .hicache_util import (  # noqa: E402
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    build_pool,
    expected_digests,
    fill_pages,
    page_digests,
    page_keys,
    storage_config,
)

TOKEN = "hicache-test-token"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = StoreCluster(str(tmp_path_factory.mktemp("hicache")), 1, token=TOKEN, durability="memory")
    cl.start_all()
    # The storage node of this process (the backends below contribute no segment of their
    # own: one engine publishes one storage segment).
    node = StoreClient(cl.address, segment_size=96 << 20, token=TOKEN, heartbeat_s=0.5)
    yield cl
    node.close()
    cl.close()


@pytest.fixture(scope="module", autouse=True)
def peer_process():
    """The other "instance", started with the module: its SGLang import (the slow part)
    overlaps the tests that come before the one that needs it."""
    from bench._common import Child

    box: dict = {}

    def start() -> None:
        try:
            box["peer"] = Child(
                [sys.executable, "-m", "tests.plugins.hicache_peer"], cwd=ROOT, timeout=120
            )
        except BaseException as e:  # noqa: BLE001 - reported by the test that needs it
            box["error"] = e

    t = threading.Thread(target=start, daemon=True)
    t.start()

    def get():
        t.join(130)
        if "error" in box:
            raise box["error"]
        return box["peer"]

    yield get
    t.join(130)
    if "peer" in box:
        box["peer"].close()


def extra(cluster, **kw):
    return {
        "backend_name": "kvmesh",
        "module_path": "kvmesh_sglang.hicache",
        "class_name": "KvmeshHiCacheStorage",
        "interface_v1": 1,
        "master": cluster.address,
        "token": TOKEN,
        "segment_size": 0,
        "namespace": "t",
        **kw,
    }


def backend(cluster, kind="mha", layout="page_first", pool=None, cfg_kw=None, **kw):
    from kvmesh_sglang.hicache import KvmeshHiCacheStorage

    pool = pool if pool is not None else build_pool(kind, layout)
    b = KvmeshHiCacheStorage(
        storage_config(mla=kind == "mla", extra=extra(cluster, **kw), **(cfg_kw or {})), {}
    )
    b.register_mem_pool_host(pool)
    return b, pool


# ----------------------------------------------------------------------------- configuration


def test_config_sources_and_priority(tmp_path):
    from kvmesh_sglang.hicache import load_config

    f = tmp_path / "kvmesh.json"
    f.write_text(json.dumps({"master": "file:1", "namespace": "from-file", "replica_num": 2}))
    env = {
        "KVMESH_HICACHE_MASTER": "env:1",
        "KVMESH_HICACHE_SEGMENT_SIZE": "1GiB",
        "KVMESH_HICACHE_NAMESPACE": "from-env",
        "KVMESH_HICACHE_CONFIG": str(f),
    }
    c = load_config({"namespace": "from-extra", "backend_name": "kvmesh"}, env)
    # extra-config > JSON file > environment > defaults, per field
    assert (c.namespace, c.master, c.segment_size, c.replica_num) == (
        "from-extra",
        "file:1",
        1 << 30,
        2,
    )
    assert load_config({}, {}).embedded and load_config({}, {}).namespace == "default"
    assert load_config({"segment_size": "4gb"}, {}).segment_size == 4 << 30
    with pytest.raises(ValueError, match="unknown keys.*mastr"):
        load_config({"mastr": "x"}, {})
    with pytest.raises(ValueError, match="segment_size"):
        load_config({"segment_size": "lots"}, {})
    with pytest.raises(ValueError, match="replica_num.*extra-config"):
        load_config({"replica_num": 0}, {})
    with pytest.raises(ValueError, match="nope.json"):
        load_config({"config_file": str(tmp_path / "nope.json")}, {})


def test_unreachable_or_wrong_token_fails_the_attach_clearly(cluster):
    from kvmesh_sglang.hicache import KvmeshHiCacheStorage

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="did not answer.*master"):
        KvmeshHiCacheStorage(storage_config(extra={"master": "127.0.0.1:9", "timeout_s": 0.5}), {})
    with pytest.raises(RuntimeError, match="did not answer"):
        KvmeshHiCacheStorage(storage_config(extra=extra(cluster, token="wrong", timeout_s=1)), {})
    assert time.monotonic() - t0 < 10


# ----------------------------------------------------------------------------- data path


@pytest.mark.parametrize("kind,layout", CASES)
def test_round_trip_every_layout_partial_prefix_write_once(cluster, kind, layout):
    a, pa = backend(cluster, kind, layout, namespace=f"rt-{kind}-{layout}")
    b, pb = backend(cluster, kind, layout, namespace=f"rt-{kind}-{layout}")
    try:
        keys = page_keys(6, f"rt{kind}{layout}")
        ps = pa.page_size
        ia, ib = pa.alloc(6 * ps), pb.alloc(6 * ps)
        fill_pages(pa, ia, list(range(100, 106)))
        want = page_digests(pa, ia, 6)
        assert b.batch_exists(keys) == 0
        assert a.batch_set_v1(keys[:4], ia[: 4 * ps]) == [True] * 4
        assert a.batch_set_v1(keys[5:], ia[5 * ps :]) == [True]  # a hole at page 4
        assert b.batch_exists(keys) == 4  # a prefix count, not a total
        assert b.batch_exists(keys[1:]) == 3
        assert b.batch_get_v1(keys, ib) == [True] * 4 + [False, True]
        assert page_digests(pb, ib, 6)[:4] + page_digests(pb, ib, 6)[5:] == want[:4] + want[5:]
        # write-once: setting again succeeds without rewriting (new bytes are not stored)
        fill_pages(pa, ia, list(range(200, 206)))
        assert a.batch_set_v1(keys[:4], ia[: 4 * ps]) == [True] * 4
        assert a.stats()["set_existing"] == 4 * (2 if kind == "mha" else 1)
        ic = pb.alloc(4 * ps)
        assert b.batch_get_v1(keys[:4], ic) == [True] * 4
        assert page_digests(pb, ic, 4) == want[:4]
        stats = b.get_stats()
        assert sum(stats.prefetch_pgs) == 10 and stats.kvmesh["get_hits"] == 9
        assert stats.kvmesh["get_misses"] == 1
        assert b.get_stats().prefetch_pgs == []  # reset by the report
    finally:
        a.close()
        b.close()


def _lists(plan):
    """A plan with its numpy columns as lists (the table path keeps them numpy), comparable."""

    def flat(xs):
        return xs.tolist() if hasattr(xs, "tolist") else [int(x) for x in xs]

    multi = plan.multi
    ptrs = [flat(x) for x in plan.ptrs] if multi else flat(plan.ptrs)
    sizes = [flat(x) for x in plan.sizes] if multi else flat(plan.sizes)
    return (plan.object_names(), ptrs, sizes, list(plan.totals), multi, plan.per_page)


@pytest.mark.parametrize("kind,layout", CASES)
def test_page_table_gives_sglangs_own_addresses(kind, layout):
    """The backend's page table (measured once per pool) plans exactly what SGLang's
    ``get_page_buffer_meta`` gives for pages in any order anywhere in the pool, as addresses
    and -- resolved to the pool's registrations -- as region offsets (a get's form); a pool
    it does not know, or whose meta is not of the table's form, gets no table (SGLang's meta
    is asked per call), and a table off by one slot is caught by the comparison."""
    import random
    from types import SimpleNamespace

    import msgspec
    import numpy as np

    from kvmesh_sglang import hicache as H

    pool = build_pool(kind, layout, layers=3, device_tokens=512)
    ps = pool.page_size
    table = H._PageTable.measure(pool, ps)
    assert table is not None
    bufs = H.KvmeshHiCacheStorage._buffers(pool)[::-1]  # registration order is no clue
    table.resolve([SimpleNamespace(ptr=t.data_ptr(), size=t.nbytes) for t in bufs])
    assert table.regions is not None
    names = H._Names("ns/", "tp0of1")

    def addresses(plan):  # a resolved plan's offsets as the addresses they name
        assert plan.regions is not None
        shape = np.shape(plan.ptrs)
        base = np.array([r.ptr for r in plan.regions], np.int64)
        at = base[np.broadcast_to(plan.reg, shape)] + plan.ptrs
        z = np.broadcast_to(plan.sizes, shape)
        return _lists(msgspec.structs.replace(plan, ptrs=at, sizes=z))

    pages = int(pool.size) // ps
    rng = random.Random(5)
    for n in (1, 3, 17):
        starts = rng.sample(range(pages), n)
        idx = torch.tensor([p * ps + j for p in starts for j in range(ps)], dtype=torch.int64)
        keys = page_keys(n, "tbl")
        want = _lists(H._plan(pool, keys, idx, names, kind == "mha"))
        assert _lists(H._plan(pool, keys, idx, names, kind == "mha", table, ps)) == want
        assert addresses(H._plan(pool, keys, idx, names, kind == "mha", table, ps, True)) == want
        off = H._PageTable(table.base + table.stride, table.stride, table.sizes)
        assert _lists(H._plan(pool, keys, idx, names, kind == "mha", off, ps)) != want
    # not of the table's form: another class, an unknown layout, a meta that is not affine
    sub = type("OtherHostPool", (type(pool),), {})
    pool.__class__ = sub
    assert H._PageTable.measure(pool, ps) is None
    pool.__class__ = sub.__mro__[1]
    real = pool.get_page_buffer_meta

    def bent(indices):
        ptrs, sizes = real(indices)
        last = (pages - 1) * ps
        return [p + 64 * (int(indices[0]) == last) for p in ptrs], sizes

    pool.get_page_buffer_meta = bent
    assert H._PageTable.measure(pool, ps) is None
    del pool.get_page_buffer_meta
    assert H._PageTable.measure(pool, ps + 1) is None  # not the pool's page size
    pool.layout = "page_first_kv_split"
    assert H._PageTable.measure(pool, ps) is None


def test_names_separate_namespaces_layouts_ranks_and_share_mla(cluster):
    keys = page_keys(3, "iso")
    a, pa = backend(cluster, "mha", "page_first", namespace="iso")
    idx = pa.alloc(3 * pa.page_size)
    fill_pages(pa, idx, [1, 2, 3])
    assert a.batch_set_v1(keys, idx) == [True] * 3
    others = [
        backend(cluster, "mha", "page_first", namespace="iso2"),  # namespace
        backend(cluster, "mha", "page_first_direct", namespace="iso"),  # layout
        backend(
            cluster,
            "mha",
            "page_first",
            namespace="iso",  # TP rank
            cfg_kw={"tp_rank": 1, "tp_size": 2},
        ),
        backend(cluster, "mha", "page_first", namespace="iso", cfg_kw={"model": "other"}),
        backend(
            cluster,
            "mha",
            "page_first",
            namespace="iso",  # dtype
            pool=build_pool("mha", "page_first", dtype=torch.float16),
        ),
        backend(cluster, "mla", "page_first", namespace="iso"),  # MHA vs MLA
    ]
    for b, pool in others:
        assert b.batch_exists(keys) == 0
        assert b.batch_get_v1(keys, pool.alloc(3 * pool.page_size)) == [False] * 3
        b.close()
    a.close()
    # MLA KV is rank-replicated: one object per page, written by one rank, read by all
    w, pw = backend(
        cluster, "mla", "page_first", namespace="iso", cfg_kw={"tp_rank": 0, "tp_size": 2}
    )
    r, pr = backend(
        cluster, "mla", "page_first", namespace="iso", cfg_kw={"tp_rank": 1, "tp_size": 2}
    )
    iw, ir = pw.alloc(3 * pw.page_size), pr.alloc(3 * pr.page_size)
    fill_pages(pw, iw, [4, 5, 6])
    assert w.batch_set_v1(keys, iw) == [True] * 3
    assert r.batch_exists(keys) == 3 and r.batch_get_v1(keys, ir) == [True] * 3
    assert page_digests(pr, ir, 3) == page_digests(pw, iw, 3)
    w.close()
    r.close()


def test_unnamed_empty_and_dash_models_do_not_read_each_others_pages(cluster):
    """A model of None, "" and "-" all used to be named "-": each deployment read the
    others' pages (8/8 pages with the other's bytes). Now each has its own objects: the
    same page hashes miss in the others, and every one reads back its own bytes."""
    keys = page_keys(4, "unnamed")
    seeds = {None: [11, 12, 13, 14], "": [21, 22, 23, 24], "-": [31, 32, 33, 34]}
    backends = {m: backend(cluster, namespace="unnamed", cfg_kw={"model": m}) for m in seeds}
    try:
        for i, (m, (b, pool)) in enumerate(backends.items()):
            # before this one writes, the pages written by the ones before it are misses
            assert b.batch_exists(keys) == 0, (m, i)
            assert b.batch_get_v1(keys, pool.alloc(4 * pool.page_size)) == [False] * 4
            idx = pool.alloc(4 * pool.page_size)
            fill_pages(pool, idx, seeds[m])
            assert b.batch_set_v1(keys, idx) == [True] * 4
        for m, (b, pool) in backends.items():
            got = pool.alloc(4 * pool.page_size)
            assert b.batch_exists(keys) == 4 and b.batch_get_v1(keys, got) == [True] * 4
            assert page_digests(pool, got, 4) == expected_digests("mha", "page_first", seeds[m])
    finally:
        for b, _ in backends.values():
            b.close()


def test_concurrent_prefetch_and_backup_threads(cluster):
    b, pool = backend(cluster, "mha", "page_first", namespace="threads")
    ps = pool.page_size
    errors: list[BaseException] = []
    want = {}

    def worker(t: int) -> None:
        try:
            for rnd in range(3):
                keys = page_keys(4, f"th{t}-{rnd % 2}")  # rounds 0 and 2 share keys
                seeds = [t * 100 + (rnd % 2) * 10 + i for i in range(4)]
                idx = pool.alloc(4 * ps)
                fill_pages(pool, idx, seeds)
                want[(t, rnd % 2)] = page_digests(pool, idx, 4)
                assert b.batch_set_v1(keys, idx) == [True] * 4
                assert b.batch_exists(keys) == 4
                out = pool.alloc(4 * ps)
                assert b.batch_get_v1(keys, out) == [True] * 4
                assert page_digests(pool, out, 4) == want[(t, rnd % 2)]
                pool.free(idx)
                pool.free(out)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    # SGLang's allocator is not thread-safe; the controller allocates on one thread too.
    lock = threading.Lock()
    alloc, free = pool.alloc, pool.free
    pool.alloc = lambda n: (lock.acquire(), alloc(n), lock.release())[1]
    pool.free = lambda i: (lock.acquire(), free(i), lock.release())[1]
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    b.close()


def test_counters_exact_across_threads_folds_and_reports():
    """The v1 counters queue one tuple per batch and fold it in later: every batch counts
    exactly once, whichever report (``get_stats`` resets) it lands in, with batches on four
    threads past several fold points while a fifth thread keeps reporting."""
    from kvmesh_sglang import hicache as H

    c = H._Counters()
    per, workers = 3 * H._FOLD + 7, 4
    reports: list[dict] = []
    done = threading.Event()

    def batches(t: int) -> None:
        for i in range(per):
            c.io("get", 2, 1 + (i + t) % 2, 4096, 0.001)
            c.io("set", 3, 3, 8192, 0.002)

    def reporter() -> None:
        while not done.is_set():
            reports.append(c.reset())
            time.sleep(0.0005)

    rep = threading.Thread(target=reporter)
    rep.start()
    ts = [threading.Thread(target=batches, args=(t,)) for t in range(workers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    done.set()
    rep.join(60)
    reports.append(c.reset())

    def total(k: str) -> int:
        return sum(r.get(k, 0) if not isinstance(r.get(k), list) else sum(r[k]) for r in reports)

    n = per * workers
    assert total("get_pages") == 2 * n and total("set_pages") == 3 * n
    hits = sum(1 + (i + t) % 2 for t in range(workers) for i in range(per))
    assert total("get_hits") == hits and total("get_misses") == 2 * n - hits
    assert total("get_bytes") == 4096 * n and total("set_written") == 3 * n
    assert sum(len(r.get("get_seconds", [])) for r in reports) == n
    assert total("prefetch_pgs") == 2 * n and total("backup_pgs") == 3 * n
    # A read shows the queued batches (fewer than a fold's worth) without resetting them.
    c.io("get", 5, 5, 1, 0.001)
    assert c.snapshot()["get_pages"] == 5
    assert c.reset()["get_hits"] == 5


def test_factory_dynamic_path_end_to_end(cluster):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvmesh_sglang.hicache import KvmeshHiCacheStorage

    pool = build_pool("mha", "page_first")
    cfg = storage_config(extra=extra(cluster, namespace="factory"))
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    assert type(b) is KvmeshHiCacheStorage
    engine = b.client.engine
    regions = len(engine.regions())
    b.register_mem_pool_host(pool)  # as the controller does after creating it
    # the pool's buffers (0.5.23: K and V; 0.5.14: one kv_buffer holding both), registered
    # once with the process-wide engine
    from kvmesh.transfer import get_engine

    get = getattr(pool, "get_hybrid_pool_buffer", None)
    bufs = list(get()) if get is not None else [pool.kv_buffer]
    assert engine is get_engine() and len(engine.regions()) == regions + len(bufs)
    for buf in bufs:
        region, off = engine.find_region(buf.data_ptr(), buf.numel() * buf.element_size())
        assert off == 0 and region.size == buf.numel() * buf.element_size()
    keys = page_keys(2, "factory")
    idx = pool.alloc(2 * pool.page_size)
    fill_pages(pool, idx, [1, 2])
    assert b.batch_set_v1(keys, idx) == [True, True]
    out = pool.alloc(2 * pool.page_size)
    assert b.batch_exists(keys) == 2 and b.batch_get_v1(keys, out) == [True, True]
    assert page_digests(pool, out, 2) == page_digests(pool, idx, 2)
    b.register_mem_pool_host(pool)  # again: nothing new registered, no per-call registration
    assert len(engine.regions()) == regions + len(bufs)
    b.close()
    assert len(engine.regions()) == regions  # close() hands the pool's memory back
    bad = storage_config(extra=dict(extra(cluster), master="127.0.0.1:9", timeout_s=0.3))
    with pytest.raises(RuntimeError, match="kvmesh HiCache"):
        StorageBackendFactory.create_backend("dynamic", bad, pool)


def test_generic_get_set_paths(cluster):
    b, pool = backend(cluster, "mha", "layer_first", namespace="generic")
    keys = [k + ".draft" for k in page_keys(3, "generic")]
    idx = pool.alloc(3 * pool.page_size)
    fill_pages(pool, idx, [5, 6, 7])
    pages = [
        pool.get_data_page(int(idx[i * pool.page_size]), flat=True).contiguous() for i in range(3)
    ]
    assert not b.exists(keys[0])
    assert b.set(keys[0], pages[0]) is True
    assert b.batch_set(keys, pages) is True  # keys[0] already there: still True
    assert b.exists(keys[2]) and b.batch_exists(keys) == 0  # flat objects are not v1 pages
    dummies = [pool.get_dummy_flat_data_page() for _ in range(4)]
    got = b.batch_get(keys + ["f" * 64], dummies)
    assert [g is not None for g in got] == [True, True, True, False]
    assert all(torch.equal(got[i], pages[i]) for i in range(3))
    assert torch.equal(b.get(keys[1], pool.get_dummy_flat_data_page()), pages[1])
    b.close()


def test_v2_sidecar_pools(cluster):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    b, kv = backend(cluster, "mha", "page_first", namespace="v2")
    draft = build_pool("mha", "page_first", layers=1)
    idxr = build_pool("mla", "page_first", layers=2, mla_dim=16)
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    b.register_mem_host_pool_v2(draft, PoolName.DRAFT)
    b.register_mem_host_pool_v2(idxr, PoolName.INDEXER)
    b.on_host_pools_registered()
    keys = page_keys(4, "v2")
    ps = kv.page_size
    ik, idd, ii = kv.alloc(4 * ps), draft.alloc(4 * ps), idxr.alloc(4 * ps)
    fill_pages(kv, ik, [1, 2, 3, 4])
    fill_pages(draft, idd, [5, 6, 7, 8])
    fill_pages(idxr, ii, [9, 10, 11, 12])
    assert b.batch_set_v1(keys, ik) == [True] * 4
    sets = [
        PoolTransfer(name=PoolName.DRAFT, host_indices=idd, keys=keys),
        PoolTransfer(name=PoolName.INDEXER, host_indices=ii[: 2 * ps], keys=keys[:2]),
    ]
    assert b.batch_set_v2(sets) == {"draft": [True] * 4, "indexer": [True, True]}
    q = [
        PoolTransfer(name=PoolName.DRAFT, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES),
        PoolTransfer(name=PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES),
    ]
    res = b.batch_exists_v2(keys, q)
    assert res.kv_hit_pages == 2 and res.extra_pool_hit_pages["draft"] == 4
    # 0.5.14's result has no restorable_prefix_pages (sglang-interfaces.md §7)
    assert getattr(res, "restorable_prefix_pages", [1, 2]) == [1, 2]
    # trailing window of one page: every prefix ending on a stored indexer page
    trail = [
        PoolTransfer(name=PoolName.INDEXER, keys=keys[:1], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    ]
    res = b.batch_exists_v2(keys, trail)
    assert res.kv_hit_pages == 2
    assert getattr(res, "restorable_prefix_pages", [1, 2]) == [1, 2]
    od, oi = draft.alloc(4 * ps), idxr.alloc(4 * ps)
    gets = [
        PoolTransfer(name=PoolName.DRAFT, host_indices=od, keys=keys),
        PoolTransfer(name=PoolName.INDEXER, host_indices=oi, keys=keys),
    ]
    assert b.batch_get_v2(gets) == {"draft": [True] * 4, "indexer": [True, True, False, False]}
    assert page_digests(draft, od, 4) == page_digests(draft, idd, 4)
    assert page_digests(idxr, oi, 2) == page_digests(idxr, ii, 2)
    # an unregistered pool is a per-pool failure, not an exception in SGLang's thread
    assert b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=od, keys=keys)]) == {
        "mamba": [False] * 4
    }
    b.close()


def test_block_group_pages_definition():
    from kvmesh_sglang.hicache import block_group_pages as bg

    t, f = True, False
    # groups of 2 keys, each covering a block of 4 pages: leading complete groups count
    assert bg([t, t, t, t], 4, 2, 100) == 8
    assert bg([t, t, f, t], 4, 2, 100) == 4
    assert bg([f, t, t, t], 4, 2, 100) == 0  # a hole ends the run: later groups do not count
    assert bg([t, t, t], 4, 2, 100) == 4  # a trailing partial group never counts
    assert bg([t, t, t, t], 4, 2, 6) == 6  # capped at the call's span
    assert bg([t, t], 0, 2, 100) == 0 and bg([t, t], 4, 0, 100) == 0 and bg([], 4, 2, 9) == 0


def test_v2_block_groups_policy(cluster):
    """0.5.23's BLOCK_GROUPS on real SGLang types: the pool's own keys are checked in whole
    groups, the covered pages are its verdict, and the KV hit is never gated by it."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    if not hasattr(PoolHitPolicy, "BLOCK_GROUPS"):
        pytest.skip("this SGLang has no BLOCK_GROUPS hit policy (0.5.14)")
    b, kv = backend(cluster, "mha", "page_first", namespace="blockgroups")
    blk = build_pool("mla", "page_first", layers=1, mla_dim=16)
    name = PoolName.DEEPSEEK_V4_C4
    b.register_mem_host_pool_v2(blk, name)
    keys = page_keys(8, "bg-kv")
    gkeys = page_keys(5, "bg-groups")  # the pool's own keys: 2 whole groups and one key
    ps = kv.page_size
    ik = kv.alloc(8 * ps)
    fill_pages(kv, ik, list(range(8)))
    assert b.batch_set_v1(keys[:3], ik[: 3 * ps]) == [True] * 3
    ib = blk.alloc(5 * blk.page_size)
    fill_pages(blk, ib, [20, 21, 22, 23, 24])

    def put(i):
        sel = ib[i * blk.page_size : (i + 1) * blk.page_size]
        assert b.batch_set_v2([PoolTransfer(name=name, host_indices=sel, keys=[gkeys[i]])]) == {
            str(name): [True]
        }

    def ask(span=keys):
        q = PoolTransfer(
            name=name, keys=gkeys, hit_policy=PoolHitPolicy.BLOCK_GROUPS, block_pages=4,
            group_pages=2,
        )  # fmt: skip
        return b.batch_exists_v2(span, [q])

    for i in (0, 1, 3, 4):
        put(i)
    res = ask()
    # group 0 complete (pages 0-3), group 1 lacks key 2: 4 pages; KV holds 3 and is not
    # cut or extended by the pool
    assert res.kv_hit_pages == 3 and res.restorable_prefix_pages == [1, 2, 3]
    assert res.extra_pool_hit_pages[str(name)] == 4
    put(2)
    res = ask()
    assert res.extra_pool_hit_pages[str(name)] == 8 and res.kv_hit_pages == 3
    assert ask(keys[:6]).extra_pool_hit_pages[str(name)] == 6  # capped at the span
    # wrong geometry is no hit for that pool, still no exception into SGLang's thread
    q = PoolTransfer(name=name, keys=gkeys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)
    res = b.batch_exists_v2(keys, [q])
    assert str(name) not in res.extra_pool_hit_pages and res.kv_hit_pages == 3
    # the groups read back into fresh slots, byte for byte
    out = blk.alloc(5 * blk.page_size)
    got = b.batch_get_v2([PoolTransfer(name=name, host_indices=out, keys=gkeys)])
    assert got == {str(name): [True] * 5}
    assert page_digests(blk, out, 5) == page_digests(blk, ib, 5)
    b.close()


def test_another_process_reads_and_writes_pages(cluster, peer_process):
    peer = peer_process()
    for kind, layout in (("mha", "page_first"), ("mla", "layer_first")):
        ns = f"xproc-{kind}"
        ex = extra(cluster, namespace=ns)
        peer.call("open", name=kind, kind=kind, layout=layout, extra=ex)
        a, pa = backend(cluster, kind, layout, namespace=ns)
        keys = page_keys(5, ns)
        ps = pa.page_size
        # this process writes 3 pages; the other one finds exactly that prefix and reads
        ia = pa.alloc(5 * ps)
        fill_pages(pa, ia, [7, 8, 9, 10, 11])
        assert a.batch_set_v1(keys[:3], ia[: 3 * ps]) == [True] * 3
        r = peer.call("get", name=kind, keys=keys)
        assert r["exists"] == 3 and r["ok"] == [True] * 3 + [False] * 2
        assert r["digests"][:3] == page_digests(pa, ia, 3)
        # the other process writes the rest; this one reads all five into fresh slots
        r = peer.call("set", name=kind, keys=keys, seeds=[7, 8, 9, 10, 11])
        assert r["ok"] == [True] * 5
        ib = pa.alloc(5 * ps)
        assert a.batch_exists(keys) == 5
        assert a.batch_get_v1(keys, ib) == [True] * 5
        assert page_digests(pa, ib, 5) == r["digests"] == page_digests(pa, ia, 5)
        a.close()


def test_failures_are_misses_never_exceptions_or_wrong_bytes(cluster, monkeypatch):
    from kvmesh.store import errors as E

    b, pool = backend(cluster, "mha", "page_first", namespace="fail")
    keys = page_keys(3, "fail")
    ps = pool.page_size
    idx = pool.alloc(3 * ps)
    fill_pages(pool, idx, [1, 2, 3])
    assert b.batch_set_v1(keys, idx) == [True] * 3
    # malformed calls: per-page False / 0, no exception
    assert b.batch_get_v1(keys, idx[:ps]) == [False] * 3
    assert b.batch_set_v1(keys, None) == [False] * 3
    # a read whose lease expired mid-copy, or that filled fewer bytes than the page: a miss
    real = b.client.get_into_regions  # the get of a pool whose page table knows its regions

    def flaky(*args, **kwargs):
        res = real(*args, **kwargs)
        res[0] = E.LeaseExpired("planted")
        res[3] = res[3] - 1  # page 1's V object came back one byte short
        return res

    monkeypatch.setattr(b.client, "get_into_regions", flaky)
    out = pool.alloc(3 * ps)
    assert b.batch_get_v1(keys, out) == [False, False, True]
    monkeypatch.setattr(b.client, "get_into_regions", lambda *a, **k: 1 / 0)
    assert b.batch_get_v1(keys, out) == [False] * 3
    assert b.stats()["errors"] >= 3
    b.close()


# ----------------------------------------------------------------------------- Mooncake


@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mla", "layer_first")])
def test_sglang_mooncake_store_runs_unchanged_on_kvmesh(cluster, monkeypatch, kind, layout):
    from kvmesh_sglang import mooncake_compat

    monkeypatch.setenv("KVMESH_TOKEN", TOKEN)
    assert mooncake_compat._real_mooncake() is None  # nothing to shadow on this box
    mooncake_compat.load()  # opt-in: without KVMESH_SGLANG_MOONCAKE nothing happens
    assert not mooncake_compat.installed()
    monkeypatch.setenv(mooncake_compat.ENV, "1")
    mooncake_compat.load()
    assert mooncake_compat.installed()
    try:
        from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

        pool = build_pool(kind, layout)
        cfg = storage_config(
            mla=kind == "mla",
            extra={
                "master_server_address": cluster.address,
                "global_segment_size": 0,
                "protocol": "tcp",
                "extra_backend_tag": f"mc-{kind}",
            },
        )
        store = MooncakeStore(cfg, pool)
        store.register_mem_pool_host(pool)
        keys = page_keys(4, f"mc{kind}")
        ps = pool.page_size
        idx, out = pool.alloc(4 * ps), pool.alloc(4 * ps)
        fill_pages(pool, idx, [1, 2, 3, 4])
        assert store.batch_exists(keys) == 0
        assert store.batch_set_v1(keys[:3], idx[: 3 * ps]) == [True] * 3
        assert store.batch_set_v1(keys[:3], idx[: 3 * ps]) == [True] * 3  # exists: skipped
        assert store.batch_exists(keys) == 3
        assert store.batch_get_v1(keys, out) == [True] * 3 + [False]
        assert page_digests(pool, out, 3) == page_digests(pool, idx, 3)
        assert page_digests(pool, out, 3) == expected_digests(kind, layout, [1, 2, 3])
        store.close()  # SGLang's: a no-op, Mooncake's destructor closes the store
        engine = store.store.client.engine
        lo = pool.kv_buffer.data_ptr()
        hi = lo + pool.kv_buffer.numel() * pool.kv_buffer.element_size()
        assert any(lo <= r.ptr < hi for r in engine.regions())
        del store
        gc.collect()
        # The pool's registrations went with the store (its memory may be reused next).
        assert not any(lo <= r.ptr < hi for r in engine.regions())
    finally:
        mooncake_compat.uninstall()
    assert "mooncake" not in sys.modules


# ----------------------------------------------------------------------------- clear


def test_clear_removes_only_its_own_namespace_and_model(cluster):
    """``clear()`` (SGLang's HTTP clear endpoint) used to remove every object in the store:
    one deployment's clear wiped every other deployment sharing it. Now it removes its own
    ``{namespace}/{model}/`` prefix only."""
    keys = page_keys(4, "clr")
    a, pa = backend(cluster, "mha", "page_first", namespace="clr-a")
    b, pb = backend(cluster, "mha", "page_first", namespace="clr-b")
    m, pm = backend(cluster, "mha", "page_first", namespace="clr-a", cfg_kw={"model": "other"})
    written = {}
    for be, pool, seed in ((a, pa, 10), (b, pb, 20), (m, pm, 30)):
        idx = pool.alloc(4 * pool.page_size)
        fill_pages(pool, idx, [seed + i for i in range(4)])
        assert be.batch_set_v1(keys, idx) == [True] * 4
        written[id(be)] = page_digests(pool, idx, 4)
    before = a.client.status()["usage"]["objects"]
    a.clear()
    assert a.batch_exists(keys) == 0
    assert a.batch_get_v1(keys, pa.alloc(4 * pa.page_size)) == [False] * 4
    for be, pool in ((b, pb), (m, pm)):  # another namespace; same namespace, another model
        out = pool.alloc(4 * pool.page_size)
        assert be.batch_exists(keys) == 4
        assert be.batch_get_v1(keys, out) == [True] * 4
        assert page_digests(pool, out, 4) == written[id(be)]
    after = a.client.status()["usage"]["objects"]
    assert before - after == 8  # a's 4 pages, K and V each
    for be in (a, b, m):
        be.close()


# ----------------------------------------------------------------------------- store down


def test_store_down_then_restarted(cluster):
    b, pool = backend(
        cluster, "mha", "page_first", namespace="down", timeout_s=1.0, down_backoff_s=3.0
    )
    keys = page_keys(2, "down")
    ps = pool.page_size
    idx, out = pool.alloc(2 * ps), pool.alloc(2 * ps)
    fill_pages(pool, idx, [1, 2])
    assert b.batch_set_v1(keys, idx) == [True, True]
    cluster.kill(1)
    t0 = time.monotonic()
    assert b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, out) == [False, False]
    assert b.batch_set_v1(keys, idx) == [False, False]
    assert b.exists(keys[0]) is False and b.get_stats() is not None
    assert time.monotonic() - t0 < 8  # bounded: timeout_s, then answered at once
    cluster.start(1)  # a fresh, empty master (memory mode) at the same address, within
    # the back-off window the failures above opened
    deadline = time.monotonic() + 20
    # Retried more often than down_backoff_s, as SGLang's threads do: the fast misses of
    # the back-off window must not keep the backend from trying the store again.
    while b.batch_set_v1(keys, idx) != [True, True]:  # the storage node mounts again
        assert time.monotonic() < deadline, "no recovery after the master came back"
        time.sleep(0.1)
    assert b.batch_exists(keys) == 2 and b.batch_get_v1(keys, out) == [True, True]
    assert page_digests(pool, out, 2) == page_digests(pool, idx, 2)
    b.close()
