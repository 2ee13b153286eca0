"""``kvmesh demo``: prefix KV pages through the store, end to end on one host.

This process runs an embedded master and a storage node (a shared-memory segment). Two
worker processes are started: a *prefill* worker WRITEs batches of KV pages (keys form a
prefix hash chain) from its registered buffer into the store, and a *decode* worker asks how
many leading pages exist, READs them into its own registered buffer and verifies every byte
against the writer's digests. The decode side runs twice: on this host (shared memory) and
as if on another host (forced network path). A table reports pages/s, GB/s, hit rate, the
transport the engine used and the ratio to a single-thread memcpy measured in the same run.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import time
from typing import Any

import numpy as np

__all__ = ["run_demo", "worker_main"]


def _page_keys(n: int, tag: str) -> list[str]:
    """A prefix hash chain: page i's key covers every token block before it."""
    keys, h = [], tag.encode()
    for i in range(n):
        h = hashlib.blake2b(h + i.to_bytes(8, "little"), digest_size=16).digest()
        keys.append(f"kv-{h.hex()}")
    return keys


def _digests(arr: np.ndarray, n: int, page: int) -> list[str]:
    return [
        hashlib.blake2b(arr[i * page : (i + 1) * page], digest_size=16).hexdigest()
        for i in range(n)
    ]


def worker_main(argv: list[str]) -> int:
    """``python -m kvmesh.store.demo --worker MASTER``: JSON-line commands on stdin."""
    from .client import StoreClient

    master = argv[argv.index("--worker") + 1]
    c = StoreClient(master, token=os.environ.get("KVMESH_TOKEN"))
    buf: np.ndarray | None = None

    def say(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    say({"ready": c.engine.address, "host": c.engine.host_id})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        n, page, tag = cmd["pages"], cmd["page_bytes"], cmd["tag"]
        if buf is None or buf.size < n * page:
            if buf is not None:
                c.unregister_buffer(buf)
            buf = np.empty(n * page, np.uint8)
            c.register_buffer(buf)
        keys = _page_keys(n, tag)
        offs = [i * page for i in range(n)]
        if op == "write":
            # KV-like content: float16 activations, different for every page and round
            rng = np.random.default_rng(cmd["seed"])
            buf[: n * page] = (
                rng.standard_normal(n * page // 2, dtype=np.float32)
                .astype(np.float16)
                .view(np.uint8)
            )
            t0 = time.perf_counter()
            res = c.put_from(keys, buf, offs, [page] * n)
            dt = time.perf_counter() - t0
            say(
                {
                    "seconds": dt,
                    "ok": sum(1 for r in res if r is None),
                    "transports": res.transports,
                    "digests": _digests(buf, n, page),
                }
            )
        elif op == "read":
            buf[: n * page] = 0
            t0 = time.perf_counter()
            ex = c.exists(keys)
            hits = next((i for i, e in enumerate(ex) if not e), n)  # leading consecutive hits
            res = c.get_into(keys[:hits], buf, offs[:hits], [page] * hits) if hits else []
            dt = time.perf_counter() - t0
            say(
                {
                    "seconds": dt,
                    "hits": hits,
                    "read": sum(1 for r in res if isinstance(r, int)),
                    "transports": getattr(res, "transports", []),
                    "digests": _digests(buf, hits, page),
                }
            )
        else:
            say({"error": f"unknown op {op}"})
    c.close()
    return 0


class _Worker:
    def __init__(self, master: str, env: dict[str, str]) -> None:
        full = dict(os.environ)
        full.update(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.store.demo", "--worker", master],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=full,
        )
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"demo worker exited (rc={self.proc.poll()})")
            if line.startswith("{"):
                msg = json.loads(line)
                if "error" in msg:
                    raise RuntimeError(msg["error"])
                return msg

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _memcpy_gbps(size: int = 64 << 20, reps: int = 5) -> float:
    a = np.ones(size, np.uint8)
    b = np.empty_like(a)
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best.append(time.perf_counter() - t0)
    return size / float(np.median(best)) / 1e9


def run_demo(
    pages: int = 256, page_bytes: int = 64 << 10, rounds: int = 3, segment: int = 0, out: Any = None
) -> int:
    """Run the demo; returns 0 when every byte verified."""
    from ..net.security import SecurityConfig
    from ..transfer import get_engine
    from .embedded import EmbeddedMaster
    from .node import StorageNode
    from .rpc import MasterClient

    out = out or sys.stdout

    def say(msg: str) -> None:
        out.write(msg + "\n")
        out.flush()

    # One token for the master, the engines and the workers (they inherit the environment).
    os.environ.setdefault("KVMESH_TOKEN", secrets.token_hex(16))
    sec = SecurityConfig(token=os.environ["KVMESH_TOKEN"])
    t_start = time.monotonic()
    memcpy = _memcpy_gbps()
    say(f"memcpy (one thread, this run): {memcpy:.2f} GB/s")
    seg = segment or max(64 << 20, 2 * rounds * pages * page_bytes + (16 << 20))
    say(
        "starting an embedded store: master (memory mode) + a storage node segment of "
        f"{seg >> 20} MiB in this process ..."
    )
    master = EmbeddedMaster(security=sec)
    engine = get_engine()
    rpc = MasterClient([master.address], sec, name="demo-node", node_id=engine.node_id)
    node = StorageNode(rpc, seg, engine=engine).start()
    workers: list[_Worker] = []
    rows: list[dict[str, Any]] = []
    ok = True
    try:
        say(
            "starting worker processes: prefill (writer), decode on this host, "
            "decode as another host ..."
        )
        prefill = _Worker(master.address, {})
        local = _Worker(master.address, {})
        remote = _Worker(master.address, {"KVMESH_HOST_ID": "demo-other-host"})
        workers = [prefill, local, remote]
        for r in range(rounds):
            tag = f"round{r}"
            w = prefill.call(op="write", pages=pages, page_bytes=page_bytes, tag=tag, seed=r)
            rows.append(_row("prefill", "write", pages, page_bytes, w, memcpy, hit=None))
            ok &= w["ok"] == pages
            for name, wk in (("decode same host", local), ("decode other host", remote)):
                rd = wk.call(op="read", pages=pages, page_bytes=page_bytes, tag=tag)
                good = rd["digests"] == w["digests"][: rd["hits"]] and rd["read"] == rd["hits"]
                ok &= good and rd["hits"] == pages
                rows.append(
                    _row(
                        name,
                        "read",
                        rd["hits"],
                        page_bytes,
                        rd,
                        memcpy,
                        hit=rd["hits"] / pages,
                        verified=good,
                    )
                )
            say(
                f"round {r + 1}/{rounds}: {pages} pages written, read twice, "
                f"{'verified' if ok else 'MISMATCH'}"
            )
    finally:
        for wk in workers:
            wk.close()
        node.close()
        rpc.close()
        master.stop()
    _table(rows, out)
    say(
        f"done in {time.monotonic() - t_start:.1f}s; "
        f"every page {'verified' if ok else 'NOT verified'}"
    )
    return 0 if ok else 1


def _row(
    who: str,
    op: str,
    n: int,
    page: int,
    r: dict[str, Any],
    memcpy: float,
    hit: float | None,
    verified: bool = True,
) -> dict[str, Any]:
    s = max(r["seconds"], 1e-9)
    gbps = n * page / s / 1e9
    return {
        "worker": who,
        "op": op,
        "pages": n,
        "page": f"{page >> 10} KiB",
        "pages/s": f"{n / s:,.0f}",
        "GB/s": f"{gbps:.2f}",
        "x memcpy": f"{gbps / memcpy:.2f}",
        "hit rate": "-" if hit is None else f"{hit:.0%}",
        "transport": ",".join(r.get("transports") or []) or "-",
        "bytes": "ok" if verified else "BAD",
    }


def _table(rows: list[dict[str, Any]], out: Any) -> None:
    if not rows:
        return
    cols = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    out.write("  ".join(c.ljust(w) for c, w in zip(cols, widths)) + "\n")
    out.write("  ".join("-" * w for w in widths) + "\n")
    for r in rows:
        out.write("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)) + "\n")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.exit(worker_main(sys.argv))
    sys.exit(run_demo())
