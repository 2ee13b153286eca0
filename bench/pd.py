#!/usr/bin/env python
"""PD disaggregation benchmark: KV pages of requests through the kvmesh drop-in for SGLang's
Mooncake transfer engine (``kvmesh_sglang.pd.KvmeshTransferEngine``).

    python bench/pd.py [--quick] [--json PATH]

This process is the prefill side, a spawned process (``python -m bench._pd``) the decode side,
each with a CPU KV pool shaped like SGLang's: 32 layers, K and V buffers per layer, page size
64, bf16, 8 KV heads x 128 dims (one page of one layer = 128 KiB), plus aux rows. A request of
4,096 tokens is 64 pages on random slots of both pools; its blocks are built as SGLang's
Mooncake manager builds them (contiguous runs of source and destination pages, per layer
buffer) and sent with one ``batch_transfer_sync`` per request, like ``send_kvcache``:

* ``1 request``: one request at a time, latency p50/p99 and GB/s;
* ``16 concurrent``: 16 requests (``--concurrent-tokens`` each) from 4 threads, as SGLang's
  transfer workers do; GB/s over all of them and the per-request p50/p99;
* ``same-host``: decode process on this host (the engine picks NIXL/UCX cma for private memory);
  ``network``: the decode process under another host id, so the network path (``tcp``) serves;
* ``pool`` (``--pools``): ``private``: both pools in torch's own memory, as SGLang allocates
  them by default; ``shm``: both pools allocated as ``KVMESH_SGLANG_SHM_POOLS=1`` allocates
  SGLang's CPU pools (kvmesh_sglang.shm_pools), so the same-host path is the ``shm`` transport
  (memcpy into the decode process's mapped pool). shm rows run on the same-host path only (the
  network path does not depend on the pool's memory).

Every case is verified once outside the timed loop (SHA-256 of the pages on both sides). The
same run measures single-thread memcpy and one raw TCP loopback stream (bench/_common.py) at the
start, before each path and at the end (best sample: ``ratio_*``; the sample taken right
before the path: ``ratio_*_near``), and the per-call overhead of ``batch_transfer_sync`` for
1,024 blocks: the call with the transport's copy replaced by nothing (in-process, so only the
shim, the address resolution, grouping and batch bookkeeping remain).

Targets (issue 9): same-host >= 0.7 x memcpy, judged on the shm-pool rows (private pools are
reachable only through cma, one ``process_vm_writev`` stream: docs/sglang.md "Same-host
ceiling"; their rows are kept, labelled, not judged); network >= 0.6 x raw TCP; overhead
<= 1 ms.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import sys
import time
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE.parent / "plugins"))
sys.path.insert(0, str(_HERE))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402
from _pd import KVPool, geometry_argv  # noqa: E402

from kvmesh.transfer import TransportKind, get_engine  # noqa: E402
from kvmesh_sglang.pd import KvmeshTransferEngine  # noqa: E402

LAYERS, PAGE, HEADS, DIM, DTYPE = 32, 64, 8, 128, "bfloat16"
REQ_TOKENS = 4096
NETWORK_ENV = {"KVMESH_HOST_ID": "bench-decode-host"}


def _options(ap: Any) -> None:
    ap.add_argument("--reps", type=int, help="timed repetitions per case")
    ap.add_argument(
        "--concurrent-tokens",
        type=int,
        help="tokens per request in the 16-request case (default 1024; quick 256)",
    )
    ap.add_argument("--paths", default="same-host,network", help="which of same-host,network")
    ap.add_argument("--pools", default="private,shm", help="pool memory for same-host: private,shm")
    # Smaller than a real model's only for the smoke test (tests/plugins/test_pd_bench_smoke.py):
    # fewer layer buffers make the pools, their fill and their digests cheaper, same code paths.
    ap.add_argument("--layers", type=int, default=LAYERS, help=f"layers (default {LAYERS})")
    ap.add_argument(
        "--tcp-mib", type=int, help="MiB per raw TCP reference stream (default 512; quick 256)"
    )


def contiguous_runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src start, dst start, pages) of runs contiguous on both sides, as SGLang groups them."""
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], brk))
    counts = np.diff(np.concatenate((starts, [len(src)])))
    return src[starts], dst[starts], counts


def request_blocks(
    pool: KVPool, dst_ptrs: list[int], src_pages: np.ndarray, dst_pages: np.ndarray
) -> tuple[list[int], list[int], list[int]]:
    """``batch_transfer_sync`` arguments for one request: every layer buffer's runs."""
    s0, d0, n = contiguous_runs(src_pages, dst_pages)
    item = pool.item_len
    src = np.concatenate([p + s0 * item for p in pool.kv_data_ptrs])
    dst = np.concatenate([p + d0 * item for p in dst_ptrs])
    ln = np.tile(n * item, len(dst_ptrs))
    return src.tolist(), dst.tolist(), ln.tolist()  # SGLang passes Python lists


def run_path(
    path: str,
    eng: KvmeshTransferEngine,
    pool: KVPool,
    limits: dict[str, Any],
    reps: int,
    conc_pages: int,
    nconc: int,
) -> list[dict[str, Any]]:
    memory = pool.memory
    req_pages = REQ_TOKENS // PAGE
    decode_pages = req_pages + nconc * conc_pages
    rng = np.random.default_rng(1)
    child = C.Child(
        [
            sys.executable,
            "-m",
            "bench._pd",
            *geometry_argv(pool.layers, decode_pages, PAGE, HEADS, DIM, DTYPE, memory=memory),
        ],
        env=NETWORK_ENV if path == "network" else {},
        timeout=300,
        cwd=str(_HERE.parent),
    )
    rows = []
    try:
        sid, dptrs = child.info["session_id"], child.info["kv_data_ptrs"]
        slots = rng.permutation(decode_pages)
        # One request: 64 pages from random prefill slots to random decode slots.
        src_pages = rng.permutation(pool.pages)[:req_pages]
        dst_pages = slots[:req_pages]
        blocks = request_blocks(pool, dptrs, src_pages, dst_pages)
        nbytes = sum(blocks[2])
        before = dict(eng.stats["by_transport"])

        def one() -> None:
            rc = eng.batch_transfer_sync(sid, *blocks)
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync failed: {rc}")

        one()  # warm-up (first use opens the route: NIXL metadata, connections)
        lat = []
        for _ in range(reps):
            t0 = time.perf_counter()
            one()
            lat.append(time.perf_counter() - t0)
        if child.call("digest", pages=dst_pages.tolist())["digest"] != pool.page_digest(src_pages):
            raise RuntimeError(f"{path}: decode pages differ from the prefill pages")
        used = [k for k, v in eng.stats["by_transport"].items() if v != before.get(k, 0)]
        transport = ",".join(sorted(used))
        p50, p99 = C.percentiles(lat)
        rows.append(
            C.record(
                limits,
                path,
                transport,
                "write",
                pool.item_len,
                len(blocks[0]),
                gbps=nbytes / float(np.median(lat)) / 1e9,
                p50_us=p50,
                p99_us=p99,
                pool=memory,
                requests=1,
                tokens=REQ_TOKENS,
                request_bytes=nbytes,
            )
        )

        # 16 concurrent requests from 4 threads, each to its own decode pages.
        reqs = []
        for i in range(nconc):
            sp = rng.permutation(pool.pages)[:conc_pages]
            dp = slots[req_pages + i * conc_pages : req_pages + (i + 1) * conc_pages]
            reqs.append((sp, dp, request_blocks(pool, dptrs, sp, dp)))
        total = sum(sum(r[2][2]) for r in reqs)

        def send(r: Any) -> float:
            t0 = time.perf_counter()
            rc = eng.batch_transfer_sync(sid, *r[2])
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync failed: {rc}")
            return time.perf_counter() - t0

        walls, lats = [], []
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            list(ex.map(send, reqs))  # warm-up
            for _ in range(reps):
                t0 = time.perf_counter()
                lats += list(ex.map(send, reqs))
                walls.append(time.perf_counter() - t0)
        for sp, dp, _ in reqs:
            if child.call("digest", pages=dp.tolist())["digest"] != pool.page_digest(sp):
                raise RuntimeError(f"{path}: a concurrent request's pages differ")
        p50, p99 = C.percentiles(lats)
        rows.append(
            C.record(
                limits,
                path,
                transport,
                "write",
                pool.item_len,
                len(reqs[0][2][0]),
                gbps=total / float(np.median(walls)) / 1e9,
                p50_us=p50,
                p99_us=p99,
                pool=memory,
                requests=nconc,
                tokens=conc_pages * PAGE,
                request_bytes=total // nconc,
            )
        )
    finally:
        child.close()
    return rows


def call_overhead(eng: KvmeshTransferEngine, reps: int) -> list[dict[str, Any]]:
    """``batch_transfer_sync`` of 1,024 blocks with the copy itself replaced by nothing."""
    engine = get_engine()
    local = engine.transport(TransportKind.LOCAL)
    rows = []
    for buffers in (1, 64):  # one region pair; 64 = 32 layers x (K, V), SGLang's shape
        per = 1024 // buffers
        size = per * 2 * 4096
        src = [np.zeros(size, np.uint8) for _ in range(buffers)]
        dst = [np.zeros(size, np.uint8) for _ in range(buffers)]
        ptrs = [a.ctypes.data for a in src + dst]
        if eng.batch_register(ptrs, [a.nbytes for a in src + dst]) != 0:
            raise RuntimeError("batch_register failed")
        off = np.arange(per) * 2 * 4096  # every other 4 KiB slot: no two blocks merge
        s = np.concatenate([a.ctypes.data + off for a in src]).tolist()
        d = np.concatenate([a.ctypes.data + off for a in dst]).tolist()
        ln = [4096] * len(s)
        sid = eng.get_session_id()
        if eng.batch_transfer_sync(sid, s, d, ln) != 0:  # real copies once, then verified
            raise RuntimeError("batch_transfer_sync failed")
        real = local.execute
        local.execute = lambda job: None  # type: ignore[method-assign]
        try:
            lat, cpu = [], []
            for _ in range(max(reps * 20, 50)):
                c0, t0 = time.thread_time(), time.perf_counter()
                eng.batch_transfer_sync(sid, s, d, ln)
                lat.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)  # all of it runs in this thread (inline)
        finally:
            local.execute = real  # type: ignore[method-assign]
        eng.batch_deregister(ptrs)
        p50, p99 = C.percentiles(lat)
        rows.append(
            C.record(
                {},
                "overhead",
                "local (copy removed)",
                "batch_transfer_sync",
                4096,
                1024,
                p50_us=p50,
                p99_us=p99,
                region_pairs=buffers,
                cpu_us=round(float(np.median(cpu)) * 1e6, 1),
            )
        )
    return rows


def main() -> None:
    args = C.bench_args(__doc__.split("\n\n")[0], extra=_options)
    quick = args.quick
    reps = args.reps or (3 if quick else 7)
    conc_tokens = args.concurrent_tokens or (256 if quick else 1024)
    conc_pages = max(1, conc_tokens // PAGE)
    limits: dict[str, Any] = C.copy_limits()
    tcp_total = (args.tcp_mib or (256 if quick else 512)) * C.MiB
    limits["tcp_gbps"] = C.tcp_gbps(total=tcp_total)
    eng = KvmeshTransferEngine("127.0.0.1")
    memories = [m.strip() for m in args.pools.split(",")]
    pools = {}
    for memory in memories:
        pools[memory] = KVPool(
            args.layers, REQ_TOKENS // PAGE, PAGE, HEADS, DIM, DTYPE, memory=memory
        )
        pools[memory].fill(seed=9)
        if pools[memory].register(eng) != 0:
            raise RuntimeError(f"batch_register of the {memory} prefill pool failed")
    records: list[dict[str, Any]] = []
    runs = [
        (path.strip(), memory)
        for path in args.paths.split(",")
        for memory in memories
        if memory == "private" or path.strip() == "same-host"
    ]
    for path, memory in runs:
        # References sampled right before each path too: on a shared box the load drifts, and
        # the run's best sample alone can flatter the limit against a busy moment's transfer.
        near = {"memcpy_gbps": C.memcpy_gbps(), "tcp_gbps": C.tcp_gbps(total=tcp_total)}
        for k in near:
            limits[k] = max(limits[k], near[k])
        rows = run_path(path, eng, pools[memory], limits, reps, conc_pages, 16)
        for r in rows:
            r["memcpy_gbps_near"] = round(near["memcpy_gbps"], 3)
            r["tcp_gbps_near"] = round(near["tcp_gbps"], 3)
            r["ratio_memcpy_near"] = round(r["gbps"] / near["memcpy_gbps"], 3)
            r["ratio_tcp_near"] = round(r["gbps"] / near["tcp_gbps"], 3)
        records += rows
    records += call_overhead(eng, reps)
    # Best sample of the limits over the run (a busy moment must not inflate the ratios).
    C.copy_limits(limits)
    limits["tcp_gbps"] = max(limits["tcp_gbps"], C.tcp_gbps(total=tcp_total))
    C.apply_ratios(records, limits)
    for r in records:
        if r["case"] == "same-host" and r["pool"] == "shm":
            r["target"] = ">= 0.7 x memcpy"
            r["meets"] = r["ratio_memcpy"] is not None and r["ratio_memcpy"] >= 0.7
        elif r["case"] == "same-host":
            r["target"] = "not judged (private pool: cma)"
            r["meets"] = None
        elif r["case"] == "network":
            r["target"] = ">= 0.6 x raw TCP"
            r["meets"] = r["ratio_tcp"] is not None and r["ratio_tcp"] >= 0.6
        else:
            r["target"] = "<= 1 ms"  # judged on CPU time: wall time on a busy box waits for a core
            r["meets"] = r["cpu_us"] <= 1000
    print(
        f"limits: {C.copy_limits_text(limits)}, raw TCP {limits['tcp_gbps']:.2f} GB/s"
        f"; load average {os.getloadavg()[0]:.1f}"
    )
    C.print_table(
        records,
        (
            *C.FIELDS,
            "ratio_memcpy_near",
            "ratio_tcp_near",
            "pool",
            "cpu_us",
            "requests",
            "region_pairs",
            "target",
            "meets",
        ),
    )
    if args.json:
        C.write_json(
            args.json,
            "pd",
            limits,
            records,
            geometry={
                "layers": args.layers,
                "page_size": PAGE,
                "kv_heads": HEADS,
                "head_dim": DIM,
                "dtype": DTYPE,
                "request_tokens": REQ_TOKENS,
                "concurrent_request_tokens": conc_pages * PAGE,
            },
        )


if __name__ == "__main__":
    main()
