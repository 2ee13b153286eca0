#!/usr/bin/env python
"""Where one PD request's time goes on the same-host path (docs/sglang.md, "Same-host ceiling").

    python bench/pd_profile.py [--requests N] [--contiguous]
    python bench/pd_profile.py --concurrent TOKENS [--requests N]

Sends the request of bench/pd.py (32 layers, 4,096 tokens, page 64: 512 MiB, 64 jobs) N times
through ``KvmeshTransferEngine.batch_transfer_sync`` to a decode process on this host and
prints, per request: GB/s next to a memcpy sample taken right after it; then the wall and
thread-CPU time of the NIXL wrapper's stages (``make_xfer``, ``post``, ``wait``, ``release``,
summed over the threads that ran them) and the CPU time of every thread of this process
(from ``/proc/self/task``; the UCX progress or pump thread shows up there). Run it with
``KVMESH_NIXL=progress=pump`` (or other options) in alternation with the default to compare.

``--concurrent TOKENS``: the 16-concurrent shape of bench/pd.py on shared-memory pools (the
``shm`` transport): 16 requests of TOKENS tokens from 4 threads, each sent through
``batch_transfer_sync`` and, alternating with it, copied *raw* (the same blocks, the same
threads, one ``fastcopy.copy`` per block into the decode pool's mapping: no engine, no fence,
no checks); prints GB/s and process CPU of both, then the thread CPU per request of both from
one thread, so the engine's own cost (engine minus raw) shows apart from the copy and from the
box's load. ``--requests`` rounds of each.
"""

from __future__ import annotations

import collections
import concurrent.futures as concurrent_futures
import os
import pathlib
import resource
import sys
import threading
import time
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE.parent / "plugins"))
sys.path.insert(0, str(_HERE))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402
from _pd import KVPool, geometry_argv  # noqa: E402
from pd import DIM, DTYPE, HEADS, LAYERS, PAGE, REQ_TOKENS, request_blocks  # noqa: E402

from kvmesh.transfer.nixl import agent as nixl_agent  # noqa: E402
from kvmesh.transfer.nixl import xfer as nixl_xfer  # noqa: E402
from kvmesh_sglang.pd import KvmeshTransferEngine  # noqa: E402

_stages: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
_lock = threading.Lock()


def _timed(cls: Any, name: str) -> None:
    fn = getattr(cls, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            with _lock:
                s = _stages[name]
                s[0] += 1
                s[1] += time.perf_counter() - t0
                s[2] += time.thread_time() - c0

    setattr(cls, name, wrapper)


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of every thread of this process."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in pathlib.Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[task.name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> None:
    def options(ap: Any) -> None:
        ap.add_argument("--requests", type=int, default=6)
        ap.add_argument(
            "--contiguous",
            action="store_true",
            help="pages 0..63 on both sides (one run per layer buffer)",
        )
        ap.add_argument("--concurrent", type=int, metavar="TOKENS", help="see the docstring")
        ap.add_argument("--threads", type=int, default=4, help="--concurrent: sending threads")
        ap.add_argument("--cprofile", action="store_true", help="--concurrent: cProfile 10 rounds")

    args = C.bench_args(__doc__.split("\n\n")[0], extra=options)
    if args.concurrent:
        concurrent(args.concurrent, args.requests, threads=args.threads, cprofile=args.cprofile)
        return
    for cls, name in (
        (nixl_agent.NixlAgent, "make_xfer"),
        (nixl_xfer.NixlXfer, "post"),
        (nixl_xfer.NixlXfer, "wait"),
        (nixl_xfer.NixlXfer, "release"),
    ):
        _timed(cls, name)
    pages = REQ_TOKENS // PAGE
    eng = KvmeshTransferEngine("127.0.0.1")
    pool = KVPool(LAYERS, pages, PAGE, HEADS, DIM, DTYPE)
    pool.fill(seed=9)
    if pool.register(eng) != 0:
        raise RuntimeError("batch_register of the prefill pool failed")
    child = C.Child(
        [sys.executable, "-m", "bench._pd", *geometry_argv(LAYERS, pages, PAGE, HEADS, DIM, DTYPE)],
        env={},
        timeout=300,
        cwd=str(_HERE.parent),
    )
    try:
        rng = np.random.default_rng(1)
        src = np.arange(pages) if args.contiguous else rng.permutation(pages)
        dst = np.arange(pages) if args.contiguous else rng.permutation(pages)
        blocks = request_blocks(pool, child.info["kv_data_ptrs"], src, dst)
        nbytes, sid = sum(blocks[2]), child.info["session_id"]

        def one() -> None:
            if eng.batch_transfer_sync(sid, *blocks) != 0:
                raise RuntimeError("batch_transfer_sync failed")

        one()  # warm-up: opens the routes
        if child.call("digest", pages=dst.tolist())["digest"] != pool.page_digest(src):
            raise RuntimeError("decode pages differ from the prefill pages")
        print(
            f"{len(blocks[0])} blocks, {nbytes / C.MiB:.0f} MiB per request; NIXL progress "
            f"{eng.engine.transport('nixl').agent.progress_mode}"
        )
        _stages.clear()
        n, wall = args.requests, 0.0
        cpu0, proc0 = _thread_cpu(), time.process_time()
        for _ in range(n):
            t0 = time.perf_counter()
            one()
            dt = time.perf_counter() - t0
            wall += dt
            print(
                f"request {nbytes / dt / 1e9:.2f} GB/s   memcpy sample {C.memcpy_gbps():.2f}"
                f" GB/s   load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        cpu1, proc = _thread_cpu(), time.process_time() - proc0
        print(
            f"per request: wall {wall / n * 1e3:.1f} ms, process CPU {proc / n * 1e3:.1f} ms"
            " (memcpy samples included)"
        )
        for name, (calls, w, c) in _stages.items():
            print(
                f"  {name:9s} {calls / n:5.0f} calls  wall {w / n * 1e3:7.1f} ms  "
                f"thread CPU {c / n * 1e3:7.1f} ms"
            )
        for tid, t in sorted(cpu1.items()):
            used = (t - cpu0.get(tid, 0.0)) / n * 1e3
            if used >= 1.0:
                print(f"  thread {tid}: {used:.1f} ms CPU")
    finally:
        child.close()


def concurrent(
    tokens: int, rounds: int, nreq: int = 16, threads: int = 4, cprofile: bool = False
) -> None:
    from kvmesh.transfer import fastcopy

    pages = max(1, tokens // PAGE)
    eng = KvmeshTransferEngine("127.0.0.1")
    pool = KVPool(LAYERS, REQ_TOKENS // PAGE, PAGE, HEADS, DIM, DTYPE, memory="shm")
    pool.fill(seed=9)
    if pool.register(eng) != 0:
        raise RuntimeError("batch_register of the prefill pool failed")
    decode_pages = nreq * pages
    argv = geometry_argv(LAYERS, decode_pages, PAGE, HEADS, DIM, DTYPE, memory="shm")
    child = C.Child(
        [sys.executable, "-m", "bench._pd", *argv], env={}, timeout=300, cwd=str(_HERE.parent)
    )
    try:
        sid, dptrs = child.info["session_id"], child.info["kv_data_ptrs"]
        address = sid.removeprefix("kvmesh://")
        rng = np.random.default_rng(1)
        slots = rng.permutation(decode_pages)
        reqs = []
        for i in range(nreq):
            sp = rng.permutation(pool.pages)[:pages]
            dp = slots[i * pages : (i + 1) * pages]
            reqs.append((sp, dp, request_blocks(pool, dptrs, sp, dp)))
        total = sum(sum(r[2][2]) for r in reqs)
        if eng.batch_transfer_sync(sid, *reqs[0][2]) != 0:  # opens the routes (shm mappings)
            raise RuntimeError("batch_transfer_sync failed")
        plans = []  # (absolute destination in our mapping, source, length) per block
        for _, _, (src, dst, ln) in reqs:
            d, ln64 = np.array(dst, np.uint64), np.array(ln, np.uint64)
            segs, si, ro = eng.engine.locate_many(address, d, ln64)
            used = [segs[j] for j in sorted(set(si.tolist()))]
            if any(set(s.transports().values()) != {"shm"} for s in used):
                raise RuntimeError(f"not served by shm: {[s.transports() for s in used]}")
            base = np.zeros(len(segs), np.uint64)
            for j in set(si.tolist()):
                base[j] = next(iter(segs[j]._routes.values())).route.base

            plans.append(list(zip((base[si] + ro).tolist(), src, ln)))

        def engine_one(i: int) -> None:
            if eng.batch_transfer_sync(sid, *reqs[i][2]) != 0:
                raise RuntimeError("batch_transfer_sync failed")

        def raw_one(i: int) -> None:
            copy = fastcopy.copy
            for d, s, n in plans[i]:
                copy(d, s, n)

        print(
            f"{nreq} requests x {pages * PAGE} tokens ({total / nreq / C.MiB:.0f} MiB, "
            f"{len(reqs[0][2][0])} blocks, 64 region pairs each) from {threads} threads; "
            f"copy kernel {fastcopy.choice().label}"
        )
        with concurrent_futures.ThreadPoolExecutor(threads) as ex:
            for fn in (engine_one, raw_one):
                list(ex.map(fn, range(nreq)))  # warm-up
            for _ in range(rounds):
                for name, fn in (("engine", engine_one), ("raw", raw_one)):
                    g0, r0 = fastcopy.gate_stats(), resource.getrusage(resource.RUSAGE_SELF)
                    c0, t0 = time.process_time(), time.perf_counter()
                    list(ex.map(fn, range(nreq)))
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    g1, r1 = fastcopy.gate_stats(), resource.getrusage(resource.RUSAGE_SELF)
                    print(
                        f"  {name:6s} {threads} threads: {total / wall / 1e9:5.2f} GB/s, "
                        f"process CPU {cpu / nreq * 1e3:5.2f} ms per request, switches "
                        f"{r1.ru_nvcsw - r0.ru_nvcsw} voluntary / {r1.ru_nivcsw - r0.ru_nivcsw}"
                        f" forced, slots taken {g1['taken'] - g0['taken']} (waited "
                        f"{g1['waited'] - g0['waited']}), load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
        for sp, dp, _ in reqs:
            if child.call("digest", pages=dp.tolist())["digest"] != pool.page_digest(sp):
                raise RuntimeError("decode pages differ from the prefill pages")
        if cprofile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(10):
                for i in range(nreq):
                    engine_one(i)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        for _ in range(rounds):
            per = {}
            for name, fn in (("engine", engine_one), ("raw", raw_one)):
                c0 = time.thread_time()
                for i in range(nreq):
                    fn(i)
                per[name] = (time.thread_time() - c0) / nreq * 1e3
            print(
                f"  one thread, CPU per request: engine {per['engine']:.2f} ms, raw "
                f"{per['raw']:.2f} ms, engine's own {per['engine'] - per['raw']:+.2f} ms",
                flush=True,
            )
    finally:
        child.close()


if __name__ == "__main__":
    main()
