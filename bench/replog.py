"""Replicated-log benchmark (conventions: docs/bench-format.md).

    python bench/replog.py [--quick] [--json PATH] [--dir DIR]

Cases (3 replica processes on loopback, ``python -m kvmesh.replog.net.server``; clients in this
process, ~100-byte KV puts):

* ``commit``: committed + applied ops/s with ``durability=disk`` (fdatasync per batch on
  every replica) and ``memory``, across batch sizes (commands per RPC = per log entry) with
  many concurrent client sessions;
* ``latency``: single-client sequential commit latency p50/p99, disk and memory;
* ``failover``: leader SIGKILL -> first commit accepted by the new leader, p50/p99 over
  repeated kills, under background writes whose history is then checked for
  linearizability (``lost_writes`` must be 0);
* ``restart``: one replica restarting from a snapshot of 1,000,000 small objects
  (storage open + snapshot load + state-machine restore), and the cluster's time until it
  commits again.

Every timed case also verifies data (reads compared to what was written) outside the
timed window. Limits measured in the same run: ``memcpy_gbps`` (single-thread copy of
64 MiB buffers), ``copy_all_cores_gbps`` (every core copying its own part at once) and
``tcp_gbps`` (one raw loopback TCP stream).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import signal
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # run from a checkout without installing
sys.path.insert(0, _HERE)

import _common as C  # noqa: E402

from kvmesh.replog.kvsm import KvPut, KvStateMachine, KvValue  # noqa: E402
from kvmesh.replog.net.client import KvClient  # noqa: E402
from kvmesh.replog.net.server import LocalCluster  # noqa: E402
from kvmesh.replog.session import SessionStateMachine  # noqa: E402
from kvmesh.replog.sim.linearizability import (  # noqa: E402
    History,
    KvModel,
    KvOp,
    check,
    lost_acknowledged_writes,
)
from kvmesh.replog.storage.disk import DiskStorage  # noqa: E402
from kvmesh.replog.types import ConfState, ReplogError  # noqa: E402

VALUE = b"v" * 64  # key ~24 B + value 64 B + envelope: a ~100-byte PutEnd-like command
CMD_BYTES = 100


# ----------------------------------------------------------------------------- helpers


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, int(round(q / 100.0 * (len(xs) - 1)))))
    return xs[k]


async def statuses(cluster: LocalCluster) -> dict[int, dict]:
    c = KvClient(cluster.client_addrs, attempt_timeout=1.0)
    out = {}
    try:
        for i in cluster.ids:
            if cluster.alive(i):
                try:
                    out[i] = await c.status(cluster.client_addrs[i])
                except (TimeoutError, OSError, ConnectionError):
                    pass
    finally:
        await c.close()
    return out


async def find_leader(cluster: LocalCluster, timeout: float = 30.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = await statuses(cluster)
        ls = [i for i, s in st.items() if s["role"] == "LEADER"]
        if len(ls) == 1:
            return ls[0]
        await asyncio.sleep(0.05)
    raise RuntimeError("no leader")


async def wait_caught_up(cluster: LocalCluster, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = await statuses(cluster)
        if len(st) == len(cluster.ids):
            applied = [s["applied"] for s in st.values()]
            if max(applied) - min(applied) < 50:
                return
        await asyncio.sleep(0.1)
    raise RuntimeError("replicas did not catch up")


def record(case: str, op: str, **kw) -> dict:
    base = {
        "case": case,
        "transport": "tcp-loopback",
        "op": op,
        "page_bytes": CMD_BYTES,
        "batch": None,
        "gbps": None,
        "ops_per_s": None,
        "p50_us": None,
        "p99_us": None,
        "ratio_memcpy": None,
        "ratio_copy_limit": None,
        "ratio_tcp": None,
    }
    base.update(kw)
    return base


# ----------------------------------------------------------------------------- cases


async def throughput(
    cluster: LocalCluster,
    batch: int,
    sessions: int,
    inflight: int,
    warm_s: float,
    run_s: float,
    tag: str,
) -> dict:
    """``sessions`` client sessions (one connection each), each with ``inflight``
    concurrent requests of ``batch`` puts; committed ops/s in the timed window."""
    count = [0]
    timing = [False]
    stop = asyncio.Event()
    written: dict[str, bytes] = {}
    clients = [
        KvClient(cluster.client_addrs, timeout=30.0, attempt_timeout=5.0, seed=s)
        for s in range(sessions)
    ]

    async def worker(w: int) -> None:
        c = clients[w % sessions]
        n = 0
        while not stop.is_set():
            keys = [f"{tag}-{w}-{n + j:09d}" for j in range(batch)]
            n += batch
            if batch == 1:
                await c.put(keys[0], VALUE)
            else:
                await c.batch([KvPut(k, VALUE) for k in keys])
            if timing[0]:
                count[0] += batch
            written[keys[-1]] = VALUE

    for c in clients:
        await c.register()
    tasks = [asyncio.get_running_loop().create_task(worker(w)) for w in range(sessions * inflight)]
    await asyncio.sleep(warm_s)
    timing[0] = True
    t0 = time.perf_counter()
    await asyncio.sleep(run_s)
    done = count[0]
    dt = time.perf_counter() - t0
    timing[0] = False
    stop.set()
    await asyncio.gather(*tasks)
    for c in clients:
        await c.close()
    # Verify (outside the timed window): linearizable reads of a sample of written keys.
    v = KvClient(cluster.client_addrs, timeout=30.0)
    try:
        sample = random.Random(1).sample(sorted(written), min(50, len(written)))
        got = await v.get_many(sample)
        assert got == [written[k] for k in sample], "read-back mismatch"
    finally:
        await v.close()
    return {"ops_per_s": done / dt, "verified": len(sample)}


async def latency(cluster: LocalCluster, n: int, tag: str) -> dict:
    c = KvClient(cluster.client_addrs, timeout=30.0)
    lat = []
    try:
        for i in range(20):  # warm-up: session, connections, leader discovery
            await c.put(f"{tag}-warm-{i}", VALUE)
        for i in range(n):
            t0 = time.perf_counter()
            await c.put(f"{tag}-{i}", VALUE)
            lat.append(time.perf_counter() - t0)
        got = await c.get_many([f"{tag}-0", f"{tag}-{n - 1}"])
        assert got == [VALUE, VALUE], "read-back mismatch"
    finally:
        await c.close()
    return {"p50_us": pct(lat, 50) * 1e6, "p99_us": pct(lat, 99) * 1e6, "ops_per_s": n / sum(lat)}


async def failover(cluster: LocalCluster, kills: int) -> dict:
    """Kill the leader ``kills`` times under background writes; returns failover times
    and the linearizability verdict of the background history."""
    h = History()
    stop = asyncio.Event()
    acked = [0]
    keys = [f"fo-{i}" for i in range(16)]

    async def writer(w: int) -> None:
        c = KvClient(
            cluster.client_addrs, timeout=10.0, attempt_timeout=1.0, seed=100 + w, max_backoff=0.1
        )
        rng = random.Random(w)
        n = 0
        try:
            while not stop.is_set():
                n += 1
                key = rng.choice(keys)
                if rng.random() < 0.25:
                    op = h.invoke(w, KvOp.get(key))
                    try:
                        v = await c.get(key)
                    except (ReplogError, OSError):
                        h.fail(op)
                    else:
                        h.ok(op, v)
                    continue
                val = f"{w}:{n}".encode()
                op = h.invoke(w, KvOp.put(key, val))
                try:
                    await c.put(key, val)
                except (ReplogError, OSError):
                    h.info(op)
                else:
                    h.ok(op, None)
                    acked[0] += 1
        finally:
            await c.close()

    writers = [asyncio.get_running_loop().create_task(writer(w)) for w in range(4)]
    probe = KvClient(cluster.client_addrs, timeout=30.0, attempt_timeout=0.3, max_backoff=0.02)
    times = []
    try:
        await probe.put("probe", b"0")
        for k in range(kills):
            await wait_caught_up(cluster)
            victim = await find_leader(cluster)
            await asyncio.sleep(0.3)
            t_kill = time.perf_counter()
            cluster.kill(victim)
            await probe.put("probe", b"%d" % k)  # issued after the kill: committed by a new leader
            times.append(time.perf_counter() - t_kill)
            cluster.start(victim)
    finally:
        stop.set()
        await asyncio.gather(*writers)
        await probe.close()
    # Final reads, then check the whole history.
    c = KvClient(cluster.client_addrs, timeout=30.0)
    final = {}
    try:
        for key in keys:
            op = h.invoke("final", KvOp.get(key))
            v = await c.get(key)
            h.ok(op, v)
            if v is not None:
                final[key] = v
    finally:
        await c.close()
    ops = h.operations()
    r = check(KvModel(), ops, timeout_s=60)
    lost = lost_acknowledged_writes(ops, final)
    return {
        "times": times,
        "acked": acked[0],
        "history_ops": len(ops),
        "linearizable": r.outcome,
        "lost_writes": len(lost) + len(r.illegal),
        "report": r.report() if r.outcome != "ok" else "",
    }


def build_snapshot_dirs(base: str, n_objects: int, ids: list[int]) -> float:
    """Data directories whose snapshot holds ``n_objects`` KV objects (frozen gc=False
    structs), as if the cluster had applied them. Returns the snapshot size in bytes."""
    inner = KvStateMachine()
    d = inner.data
    for i in range(n_objects):
        d[f"obj-{i:07d}"] = KvValue(b"x" * 40, 3)
    data = SessionStateMachine(inner).snapshot()
    for i in ids:
        st = DiskStorage.open(os.path.join(base, str(i)), bootstrap_voters=ids)
        st.create_snapshot(3, ConfState(tuple(ids)), data)
        st.close()
    return len(data)


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def restart(base: str, n_objects: int, tick_ms: float) -> dict:
    t0 = time.perf_counter()
    snap_bytes = build_snapshot_dirs(base, n_objects, [1, 2, 3])
    build_s = time.perf_counter() - t0
    cluster = LocalCluster(base, 3, tick_ms=tick_ms, election_ticks=10)
    try:
        # One replica alone: nothing competes with its recovery for the CPUs.
        t0 = time.perf_counter()
        cluster.start(1)
        wall_single = time.perf_counter() - t0
        restore_single = cluster.restore_s[1]
        rss = rss_mb(cluster.procs[1].pid)
        # Then the rest of the cluster, until it commits a write again.
        t0 = time.perf_counter()
        cluster.start(2, wait=False)
        cluster.start(3, wait=False)
        cluster.wait_ready(2)
        cluster.wait_ready(3)
        c = KvClient(cluster.client_addrs, timeout=60.0)
        try:
            await c.put("after-restart", b"1")
            serve_s = time.perf_counter() - t0
            got = await c.get_many(["obj-0000000", f"obj-{n_objects - 1:07d}", "after-restart"])
            assert got == [b"x" * 40, b"x" * 40, b"1"], f"read-back mismatch: {got}"
            # Snapshot capture on the leader while a client keeps reading through it: the
            # event loop must keep serving (shallow copy + chunked encode + file in a thread).
            leader = await find_leader(cluster)
            addr = cluster.client_addrs[leader]
            lat: list[float] = []
            stop = asyncio.Event()

            async def reader() -> None:
                r = KvClient({leader: addr}, timeout=30.0)
                try:
                    while not stop.is_set():
                        t1 = time.perf_counter()
                        await r.get("after-restart")
                        lat.append(time.perf_counter() - t1)
                finally:
                    await r.close()

            rt = asyncio.get_running_loop().create_task(reader())
            await asyncio.sleep(0.3)
            t1 = time.perf_counter()
            snap_index = await c.snapshot(addr, reset_lag=True)
            snap_s = time.perf_counter() - t1
            stop.set()
            await rt
            st = await c.status(addr)
            assert snap_index > 0
        finally:
            await c.close()
        return {
            "restore_s": restore_single,
            "process_ready_s": wall_single,
            "cluster_commit_s": serve_s,
            "restore_s_by_replica": dict(cluster.restore_s),
            "snapshot_bytes": snap_bytes,
            "build_s": build_s,
            "rss_mb": rss,
            "snapshot_s": snap_s,
            "snapshot_loop_lag_max_ms": st["loop_lag_max_s"] * 1e3,
            "snapshot_read_max_ms": max(lat) * 1e3 if lat else None,
            "snapshot_read_p99_ms": pct(lat, 99) * 1e3 if lat else None,
        }
    finally:
        cluster.close()


# ----------------------------------------------------------------------------- main


async def run(args: argparse.Namespace) -> dict:
    quick = args.quick or args.smoke
    smoke = args.smoke
    base = args.dir or tempfile.mkdtemp(prefix="kvmesh-replog-bench-")
    os.makedirs(base, exist_ok=True)
    lim = {
        "memcpy_gbps": C.memcpy_gbps(),
        "copy_all_cores_gbps": C.copy_all_cores_gbps(),
        "tcp_gbps": C.tcp_gbps(128 << 20 if quick else 512 << 20),
    }
    records: list[dict] = []
    tick_ms = 50.0  # election timeout 0.5-1.0 s (10-20 ticks); heartbeats every 50 ms

    def add(rec: dict) -> None:
        if (
            rec.get("ops_per_s") is not None
            and rec.get("gbps") is None
            and rec["op"] in ("commit", "put")
        ):
            rec["gbps"] = rec["ops_per_s"] * CMD_BYTES / 1e9
        if rec.get("gbps"):
            rec["ratio_memcpy"] = rec["gbps"] / lim["memcpy_gbps"]
            rec["ratio_copy_limit"] = rec["gbps"] / lim["copy_all_cores_gbps"]
            rec["ratio_tcp"] = rec["gbps"] / lim["tcp_gbps"]
        records.append(rec)
        _print_row(rec)

    _print_header(lim)
    warm, dur = (1.0, 3.0) if quick else (5.0, 30.0)
    batches = [1, 64] if quick else [1, 16, 64, 256]
    if smoke:
        warm, dur, batches = 0.3, 0.7, [16]
    for durability in ("disk", "memory"):
        d = os.path.join(base, f"commit-{durability}")
        cluster = LocalCluster(
            d, 3, tick_ms=tick_ms, election_ticks=10, extra_args=["--durability", durability]
        )
        try:
            cluster.start_all()
            await find_leader(cluster)
            for b in batches:
                # 64 concurrent requests for single commands (4 sessions x 16 in flight);
                # batches: 8 sessions, one request in flight each.
                sessions, inflight = (4, 16) if b == 1 else (8, 1)
                r = await throughput(cluster, b, sessions, inflight, warm, dur, f"t{b}")
                add(
                    record(
                        "commit",
                        "commit",
                        batch=b,
                        ops_per_s=r["ops_per_s"],
                        durability=durability,
                        fsync=durability == "disk",
                        clients=sessions * inflight,
                        sessions=sessions,
                        replicas=3,
                        verified_reads=r["verified"],
                    )
                )
            r = await latency(cluster, 30 if smoke else 300 if quick else 2000, "lat")
            add(
                record(
                    "latency",
                    "commit",
                    batch=1,
                    p50_us=r["p50_us"],
                    p99_us=r["p99_us"],
                    ops_per_s=r["ops_per_s"],
                    durability=durability,
                    fsync=durability == "disk",
                    clients=1,
                    replicas=3,
                )
            )
        finally:
            cluster.close()
            shutil.rmtree(d, ignore_errors=True)

    kills = 2 if smoke else 5 if quick else 20
    d = os.path.join(base, "failover")
    cluster = LocalCluster(
        d,
        3,
        tick_ms=tick_ms,
        election_ticks=10,
        extra_args=["--snapshot-threshold", "5000", "--trailing-logs", "500"],
    )
    try:
        cluster.start_all()
        await find_leader(cluster)
        r = await failover(cluster, kills)
        add(
            record(
                "failover", "commit",
                p50_us=pct(r["times"], 50) * 1e6, p99_us=pct(r["times"], 99) * 1e6,
                kills=kills, max_s=max(r["times"]), acked_writes=r["acked"],
                history_ops=r["history_ops"],
                linearizable=r["linearizable"], lost_writes=r["lost_writes"],
                election_timeout_ms=[10 * tick_ms, 20 * tick_ms], durability="disk",
            )
        )  # fmt: skip
        if r["report"]:
            print(r["report"], file=sys.stderr)
    finally:
        cluster.close()
        shutil.rmtree(d, ignore_errors=True)

    n_obj = 20_000 if smoke else 1_000_000
    d = os.path.join(base, "restart")
    try:
        r = await restart(d, n_obj, tick_ms)
        add(
            record(
                "restart", "restart", page_bytes=None, objects=n_obj,
                restart_s=r["restore_s"], process_ready_s=r["process_ready_s"],
                cluster_commit_s=r["cluster_commit_s"],
                restore_s_by_replica=r["restore_s_by_replica"], snapshot_bytes=r["snapshot_bytes"],
                rss_mb=r["rss_mb"],
                snapshot_s=r["snapshot_s"], snapshot_loop_lag_max_ms=r["snapshot_loop_lag_max_ms"],
                snapshot_read_max_ms=r["snapshot_read_max_ms"],
                snapshot_read_p99_ms=r["snapshot_read_p99_ms"],
            )
        )  # fmt: skip
    finally:
        shutil.rmtree(d, ignore_errors=True)
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    return {
        "bench": "replog",
        "machine": C.machine_info(),
        "limits": lim,
        "quick": quick,
        "smoke": smoke,
        "records": records,
    }


def _print_header(lim: dict) -> None:
    print(f"limits: {C.copy_limits_text(lim)}, tcp loopback {lim['tcp_gbps']:.2f} GB/s")
    print(
        f"{'case':<9} {'durability':<10} {'batch':>5} {'clients':>7} {'ops/s':>10} "
        f"{'p50 ms':>8} {'p99 ms':>8}  notes"
    )


def _print_row(r: dict) -> None:
    def ms(v):
        return f"{v / 1000:.2f}" if v is not None else "-"

    ops = f"{r['ops_per_s']:.0f}" if r.get("ops_per_s") is not None else "-"
    notes = ""
    if r["case"] == "failover":
        notes = (f"{r['kills']} leader kills, max {r['max_s']:.2f}s, "
                 f"{r['acked_writes']} acked writes, "
                 f"history {r['linearizable']}, lost {r['lost_writes']}")  # fmt: skip
    elif r["case"] == "restart":
        notes = (f"{r['objects']:,} objects: restore {r['restart_s']:.2f}s, "
                 f"process ready {r['process_ready_s']:.2f}s, "
                 f"cluster commit {r['cluster_commit_s']:.2f}s, "
                 f"snapshot {r['snapshot_bytes'] / 1e6:.0f} MB, rss {r['rss_mb'] or 0:.0f} MB; "
                 f"live snapshot {r['snapshot_s']:.2f}s "
                 f"with loop lag max {r['snapshot_loop_lag_max_ms']:.0f} ms, "
                 f"reads during it max {r['snapshot_read_max_ms'] or 0:.0f} ms")  # fmt: skip
    elif r["case"] == "commit":
        notes = f"{r['gbps'] * 1000:.1f} MB/s of commands, reads verified"
    print(
        f"{r['case']:<9} {str(r.get('durability', '-')):<10} {str(r.get('batch') or '-'):>5} "
        f"{str(r.get('clients', '-')):>7} "
        f"{ops:>10} {ms(r.get('p50_us')):>8} {ms(r.get('p99_us')):>8}  {notes}",
        flush=True,
    )


def main() -> int:
    p = argparse.ArgumentParser(description="kvmesh.replog benchmark")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (< 60 s)")
    p.add_argument("--json", default=None, help="write the results as JSON to this path")
    p.add_argument(
        "--dir", default=None, help="working directory for replica data (default: a temp dir)"
    )
    p.add_argument("--smoke", action="store_true", help="a tiny run of every code path (tests)")
    args = p.parse_args()
    if not os.environ.get("KVMESH_TOKEN") and not os.environ.get("KVMESH_TOKEN_FILE"):
        # Replicas and clients authenticate as in a deployment (kvmesh.net): one random
        # cluster token for this run, inherited by the replica processes; the admin
        # snapshot request of the restart case needs it.
        os.environ["KVMESH_TOKEN"] = secrets.token_hex(16)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    t0 = time.perf_counter()
    out = asyncio.run(run(args))
    out["elapsed_s"] = time.perf_counter() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"done in {out['elapsed_s']:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
