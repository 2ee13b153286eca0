#!/usr/bin/env python
"""Where one PD request's time goes on the same-host path (docs/sglang.md, "Same-host ceiling").

    python bench/pd_profile.py [--requests N] [--contiguous]

Sends the request of bench/pd.py (32 layers, 4,096 tokens, page 64: 512 MiB, 64 jobs) N times
through ``KvmeshTransferEngine.batch_transfer_sync`` to a decode process on this host and
prints, per request: GB/s next to a memcpy sample taken right after it; then the wall and
thread-CPU time of the NIXL wrapper's stages (``make_xfer``, ``post``, ``wait``, ``release``,
summed over the threads that ran them) and the CPU time of every thread of this process
(from ``/proc/self/task``; the UCX progress or pump thread shows up there). Run it with
``KVMESH_NIXL=progress=pump`` (or other options) in alternation with the default to compare.
"""

from __future__ import annotations

import collections
import os
import pathlib
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

    args = C.bench_args(__doc__.split("\n\n")[0], extra=options)
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


if __name__ == "__main__":
    main()
