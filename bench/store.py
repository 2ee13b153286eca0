"""Store benchmark: batch put/get through kvmesh.StoreClient, batch exists, single get_into
latency, metadata throughput of the replicated master (conventions: bench-format.md).

Setup: master replica processes on loopback (one, in memory, for the data-path cases; three
with fsync for the metadata case; one durable replica holding 1,000,000 objects for RSS and
restart time, full mode only), a storage-node helper process that owns the segment
(shared memory), and this process as the client reading into / writing from registered
buffers. ``network`` cases give the helper another host id, so the engine takes its network
path (``tcp``, or ``nixl`` with RDMA). Every timed read is verified once, outside the timing.

    python bench/store.py [--quick] [--json PATH]
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import (
    FIELDS,
    Child,
    MiB,
    bench_args,
    copy_all_cores_gbps,
    copy_limits_text,
    cpu_seconds,
    memcpy_gbps,
    peer_child,
    percentiles,
    print_table,
    record,
    serve_json_lines,
    tcp_gbps,
    timed,
    write_json,
)


def peer_main(master: str, segment: int) -> None:
    """The storage-node helper: contributes a segment until told to exit."""
    from kvmesh.store.node import StorageNode
    from kvmesh.store.rpc import MasterClient
    from kvmesh.transfer import get_engine

    engine = get_engine()
    # A storage node mounts as itself (net/identity.py): its master connection names it.
    rpc = MasterClient([master], name="bench-node", node_id=engine.node_id)
    node = StorageNode(rpc, segment, engine=engine).start()

    def on_exit() -> None:
        node.close()
        rpc.close()

    serve_json_lines({"exit": on_exit}, {"ready": node.engine.address, "host": node.engine.host_id})


def _peer(master: str, segment: int, host_id: str | None) -> Child:
    return peer_child(__file__, master, str(segment), host_id=host_id)


def _shapes(text: str) -> list[tuple[int, int]]:
    """``"16384x256,262144x128"`` -> [(page bytes, batch), ...]."""
    out = []
    for part in text.split(","):
        size, batch = part.lower().split("x")
        out.append((int(size), int(batch)))
    return out


def data_path(limits: dict, a: Any, case: str, host_id: str | None) -> list[dict[str, Any]]:
    from kvmesh.store import StoreClient
    from kvmesh.store.cluster import StoreCluster

    quick = a.quick
    shapes = [(16 << 10, 256), (256 << 10, 128), (1 * MiB, 64)] + ([] if quick else [(4 * MiB, 64)])
    if case == "network" and quick:
        shapes = [(256 << 10, 128), (1 * MiB, 64)]
    if a.shapes:
        shapes = _shapes(a.shapes)
    reps = a.reps or (3 if quick else 5)
    rows = []
    with (
        tempfile.TemporaryDirectory() as d,
        StoreCluster(d, 1, durability="memory", tick_ms=50) as cl,
    ):
        cl.start_all()
        biggest = max(max(s * b for s, b in shapes), 1 * MiB)  # exists/latency use 1 MiB
        peer = _peer(cl.address, 3 * biggest + 64 * MiB, host_id)
        c = StoreClient(cl.address, timeout=30)
        try:
            src = np.frombuffer(np.random.default_rng(1).bytes(biggest), np.uint8).copy()
            dst = np.zeros(biggest, np.uint8)
            c.register_buffer(src)
            c.register_buffer(dst)
            for size, batch in shapes:
                offs = [i * size for i in range(batch)]
                sizes = [size] * batch
                n = size * batch
                # a median of 3 one-ms puts is mostly noise (a --quick 16 KiB x 256 row read
                # 0.27 x memcpy where 20 repetitions read 0.46): small cases repeat until
                # 256 MiB moved, at most 64 times (the biggest keep ``reps``)
                n_reps = a.reps or max(reps, min(64, (256 * MiB) // n))
                gen = [0]

                def put_once() -> Any:
                    gen[0] += 1  # noqa: B023
                    keys = [f"b{size}-{gen[0]}-{i}" for i in range(batch)]  # noqa: B023
                    res = c.put_from(keys, src, offs, sizes)  # noqa: B023
                    assert res.ok, res[:3]
                    put_once.keys = keys  # type: ignore[attr-defined]
                    put_once.transports = res.transports  # type: ignore[attr-defined]
                    return res

                def cleanup() -> None:
                    c.remove(put_once.keys, force=True)  # type: ignore[attr-defined]

                times = []
                put_once()
                cleanup()
                for _ in range(n_reps):
                    t0 = time.perf_counter()
                    put_once()
                    times.append(time.perf_counter() - t0)
                    cleanup()
                t_put = float(np.median(times))
                rows.append(
                    record(
                        limits,
                        case,
                        ",".join(put_once.transports),
                        "put",  # type: ignore[attr-defined]
                        size,
                        batch,
                        gbps=n / t_put / 1e9,
                        ops_per_s=batch / t_put,
                    )
                )
                if a.put_stages:
                    rows[-1]["put_stages_us"] = _put_stages(c, put_once, cleanup, a.put_stages, cl)
                put_once()
                keys = put_once.keys  # type: ignore[attr-defined]
                got = c.get_into(keys, dst, offs, sizes)
                assert list(got) == sizes and np.array_equal(dst[:n], src[:n]), (
                    "get returned wrong bytes"
                )
                dst[:n] = 0
                transports = got.transports
                t_get = timed(lambda: c.get_into(keys, dst, offs, sizes), n_reps)  # noqa: B023
                assert np.array_equal(dst[:n], src[:n])
                rows.append(
                    record(
                        limits,
                        case,
                        ",".join(transports),
                        "get",
                        size,
                        batch,
                        gbps=n / t_get / 1e9,
                        ops_per_s=batch / t_get,
                    )
                )
                time.sleep(0.05)
                cleanup()
            if case == "cross-process":
                rows += _exists_and_latency(c, src, dst, limits, a)
        finally:
            c.close()
            peer.close()
    return rows


# The stages of one batch put as the client sees them (bench/store.py --put-stages N):
# entered put_from -> PutStart sent -> its reply -> engine write begins -> written ->
# PutEnd sent -> its reply -> put_from returns, and the master's CPU per put (/proc).
_PUT_STAGES = (
    ("client_before_put_start", "put>", "rpc0>"),
    ("put_start_round_trip", "rpc0>", "rpc0<"),
    ("client_reply_to_write", "rpc0<", "move>"),
    ("engine_write", "move>", "move<"),
    ("client_write_to_put_end", "move<", "rpc1>"),
    ("put_end_round_trip", "rpc1>", "rpc1<"),
    ("client_after_put_end", "rpc1<", "put<"),
    ("total", "put>", "put<"),
)


# The same for the one-round-trip put (a write into the client's reservation, then one
# PutCommit): entered put_from -> write begins -> written -> PutCommit sent -> its reply ->
# put_from returns.
_COMMIT_STAGES = (
    ("client_before_write", "put>", "move>"),
    ("engine_write", "move>", "move<"),
    ("client_write_to_commit", "move<", "rpc0>"),
    ("put_commit_round_trip", "rpc0>", "rpc0<"),
    ("client_after_commit", "rpc0<", "put<"),
    ("total", "put>", "put<"),
)


def _put_stages(c: Any, put_once: Any, cleanup: Any, n: int, cl: Any) -> dict[str, float]:
    """Medians over ``n`` puts of each stage of :data:`_PUT_STAGES`, in us (timers on the
    instance: ``MasterClient.mutate`` and ``StoreClient._move_arrays``, ~1 us each), plus
    ``master_cpu``: the master process's CPU per put and its cleanup (``remove``: /proc
    counts CPU in clock ticks, too coarse for one put), and ``client_cpu``: the calling
    thread's CPU per put (on a loaded machine the stage wall times are mostly waits for a
    core; CPU time is what a change to the put's own work moves)."""
    ev: dict[str, float] = {}
    clock = time.perf_counter
    rpc, mutate, move = c.rpc, c.rpc.mutate, c._move_arrays

    def timed_mutate(*args: Any, **kw: Any) -> Any:
        k = f"rpc{sum(1 for e in ev if e.startswith('rpc') and e.endswith('>'))}"
        ev[k + ">"] = clock()
        try:
            return mutate(*args, **kw)
        finally:
            ev[k + "<"] = clock()

    def timed_move(*args: Any, **kw: Any) -> Any:
        ev["move>"] = clock()
        try:
            return move(*args, **kw)
        finally:
            ev["move<"] = clock()

    pid = cl.procs[cl.ids[0]].pid
    got: dict[str, list[float]] = {name: [] for name, _, _ in _PUT_STAGES}
    got["client_cpu"] = []
    rpc.mutate, c._move_arrays = timed_mutate, timed_move
    c0 = cpu_seconds(pid)
    try:
        for _ in range(n):
            ev.clear()
            cpu0 = time.thread_time()
            ev["put>"] = clock()
            put_once()
            ev["put<"] = clock()
            got["client_cpu"].append((time.thread_time() - cpu0) * 1e6)
            if {"rpc0>", "rpc1<", "move<"} <= ev.keys() and "rpc2>" not in ev:
                for name, a0, a1 in _PUT_STAGES:  # one PutStart, one write, one PutEnd
                    got[name].append((ev[a1] - ev[a0]) * 1e6)
            elif (
                {"move>", "rpc0<"} <= ev.keys() and "rpc1>" not in ev and ev["move<"] < ev["rpc0>"]
            ):
                for name, a0, a1 in _COMMIT_STAGES:  # one write, one PutCommit
                    got.setdefault(name, []).append((ev[a1] - ev[a0]) * 1e6)
            cleanup()
    finally:
        del rpc.mutate, c._move_arrays  # back to the class's methods
    cpu = cpu_seconds(pid) - c0
    out = {k: round(float(np.median(v)), 1) for k, v in got.items() if v}
    out["master_cpu"] = round(cpu / n * 1e6, 1)
    return out


def _print_put_stages(rows: list[dict[str, Any]]) -> None:
    staged = [r for r in rows if "put_stages_us" in r]
    if not staged:
        return
    for stages in (_PUT_STAGES, _COMMIT_STAGES):
        names = [name for name, _, _ in stages] + ["client_cpu", "master_cpu"]
        rows = [r for r in staged if stages[0][0] in r["put_stages_us"]]
        if not rows:
            continue
        print("put stages, medians in us (" + ", ".join(names) + "):")
        for r in rows:
            st = r["put_stages_us"]
            cols = " ".join(f"{st.get(k, float('nan')):8.1f}" for k in names)
            print(f"  {r['case']:13s} {r['page_bytes'] >> 10:5d} KiB x {r['batch']:<4d} {cols}")


def _exists_and_latency(
    c: Any, src: np.ndarray, dst: np.ndarray, limits: dict, a: Any
) -> list[dict[str, Any]]:
    rows = []
    keys = [f"ex-{i}" for i in range(256)]
    res = c.put_from(keys, src, [i * 4096 for i in range(256)], [4096] * 256)
    assert res.ok
    assert c.exists(keys) == [True] * 256
    t = timed(lambda: c.exists(keys), a.reps or (20 if a.quick else 100), warmup=3)
    rows.append(
        record(
            limits,
            "cross-process",
            None,
            "exists",
            None,
            256,
            ops_per_s=256 / t,
            us_per_key=round(t / 256 * 1e6, 3),
        )
    )
    key = "lat-16k"
    c.put_from(key, src, 0, 16 << 10)
    assert c.get_into(key, dst, 0, 16 << 10) == 16 << 10
    assert np.array_equal(dst[: 16 << 10], src[: 16 << 10])
    samples = []
    n = a.latency_samples or (300 if a.quick else 2000)
    for _ in range(20):
        c.get_into(key, dst, 0, 16 << 10)
    for _ in range(n):
        t0 = time.perf_counter()
        c.get_into(key, dst, 0, 16 << 10)
        samples.append(time.perf_counter() - t0)
    p50, p99 = percentiles(samples)
    rows.append(
        record(
            limits,
            "latency",
            ",".join(c.last_transports),
            "get",
            16 << 10,
            1,
            ops_per_s=1 / float(np.mean(samples)),
            p50_us=p50,
            p99_us=p99,
        )
    )
    return rows


# The metadata cases mount a segment for a node that never heartbeats (no bytes move):
# the master must not expire it (and drop every object in it) during the run.
_NO_NODE_EXPIRY = ["--node-ttl-s", "3600"]


def metadata(limits: dict, a: Any) -> list[dict[str, Any]]:
    """put_start + put_end keys/s on 3 replicas with fsync, in batches, several clients."""
    from kvmesh.store import protocol as P
    from kvmesh.store.cluster import StoreCluster
    from kvmesh.store.rpc import MasterClient
    from kvmesh.store.types import ReplicateConfig

    rows = []
    batch, threads = 512, 4
    seconds = a.meta_seconds or (4.0 if a.quick else 15.0)
    with (
        tempfile.TemporaryDirectory() as d,
        StoreCluster(d, 3, durability="disk", tick_ms=50, extra_args=_NO_NODE_EXPIRY) as cl,
    ):
        cl.start_all()
        node_rpc = MasterClient(list(cl.addrs.values()), node_id="meta-node")
        # A segment is needed for allocation; no bytes move in this case.
        r = node_rpc.mutate(
            lambda rid, s: P.MountReq(rid, s, "meta-node", "meta-seg", "127.0.0.1:1", "h", 1 << 40)
        )
        assert type(r) is P.CodesResp and r.codes == [0], r
        stop = threading.Event()
        done = [0] * threads
        cfg = ReplicateConfig()

        def worker(t: int) -> None:
            rpc = MasterClient(list(cl.addrs.values()), name=f"bench-meta-{t}", timeout=30)
            i = 0
            while not stop.is_set():
                keys = [f"m{t}-{i}-{j}" for j in range(batch)]
                i += 1
                ps = rpc.mutate(lambda rid, s: P.PutStartReq(rid, s, keys, [4096] * batch, cfg))  # noqa: B023
                assert type(ps) is P.PutStartResp and not any(ps.codes), ps.codes[:3]
                pe = rpc.mutate(lambda rid, s: P.PutEndReq(rid, s, keys, ps.versions))  # noqa: B023
                assert type(pe) is P.CodesResp and not any(pe.codes)
                done[t] += batch
            rpc.close()

        ths = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(threads)]
        for th in ths:
            th.start()
        time.sleep(1.0)  # warm-up
        # CPU of every process over the timed window (where a key's cost goes: leader,
        # followers, this client), as fields of the row; nothing here changes the load.
        leader = next((i for i, a in cl.addrs.items() if a == node_rpc.leader), None)
        pids = {i: cl.procs[i].pid for i in cl.ids}
        c0 = {i: cpu_seconds(p) for i, p in pids.items()}
        me0 = cpu_seconds()
        k0, t0 = sum(done), time.perf_counter()
        time.sleep(seconds)
        k1, t1 = sum(done), time.perf_counter()
        c1 = {i: cpu_seconds(p) for i, p in pids.items()}
        me1 = cpu_seconds()
        n = max(1, k1 - k0)
        per_key = {i: (c1[i] - c0[i]) / n * 1e6 for i in pids}
        followers = [v for i, v in per_key.items() if i != leader]
        stop.set()
        for th in ths:
            th.join(60)
        node_rpc.close()
        rows.append(
            record(
                limits,
                "metadata",
                None,
                "put",
                None,
                batch,
                ops_per_s=(k1 - k0) / (t1 - t0),
                replicas=3,
                fsync=True,
                clients=threads,
                cpu_us_per_key_leader=round(per_key.get(leader, 0.0), 2),
                cpu_us_per_key_follower=round(sum(followers) / max(1, len(followers)), 2),
                cpu_us_per_key_client=round((me1 - me0) / n * 1e6, 2),
                cores_used=round((sum(c1[i] - c0[i] for i in pids) + me1 - me0) / (t1 - t0), 2),
            )
        )
    return rows


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def million(limits: dict, a: Any) -> list[dict[str, Any]]:
    """A master holding ``a.objects`` objects (default 1,000,000): its RSS once loaded, and
    the time a restart from its data directory takes until it answers reads again (READY,
    leader, state recovered): after kill -9 (the log since the last snapshot is replayed)
    and after a graceful stop (which snapshots first, so the image is restored). One durable
    replica: the replicas of a group each hold the same table, so one shows the per-process
    figures."""
    return _big_master(limits, a.objects or 1_000_000, "sglang-page-{:016x}")


TEN_M_KEY = "sglang-hicache-{:064x}-tp0-k"  # HiCache-shaped: a page hash, ~100 bytes


def ten_million(limits: dict, a: Any) -> list[dict[str, Any]]:
    """:func:`million` at 10,000,000 objects with HiCache-shaped keys (issue 21's targets:
    RSS <= 300 bytes per object plus the key bytes, restarts <= 15 s); full run only."""
    return _big_master(limits, 10_000_000, TEN_M_KEY)


def _big_master(limits: dict, n: int, key: str) -> list[dict[str, Any]]:
    from kvmesh.store import protocol as P
    from kvmesh.store.cluster import StoreCluster
    from kvmesh.store.rpc import MasterClient
    from kvmesh.store.types import ReplicateConfig

    batch = 4096
    cfg = ReplicateConfig()
    with (
        tempfile.TemporaryDirectory() as d,
        StoreCluster(d, 1, durability="disk", extra_args=_NO_NODE_EXPIRY) as cl,
    ):
        cl.start_all()
        rss_empty = _rss_mib(cl.procs[1].pid)
        rpc = MasterClient([cl.address], node_id="big-node", timeout=60)
        r = rpc.mutate(
            lambda rid, s: P.MountReq(rid, s, "big-node", "big-seg", "127.0.0.1:1", "h", 1 << 40)
        )
        assert type(r) is P.CodesResp and r.codes == [0], r
        t0 = time.perf_counter()
        for lo in range(0, n, batch):
            keys = [key.format(i) for i in range(lo, min(n, lo + batch))]
            ps = rpc.mutate(lambda rid, s: P.PutStartReq(rid, s, keys, [16384] * len(keys), cfg))  # noqa: B023
            assert type(ps) is P.PutStartResp and not any(ps.codes), ps
            pe = rpc.mutate(lambda rid, s: P.PutEndReq(rid, s, keys, ps.versions))  # noqa: B023
            assert type(pe) is P.CodesResp and not any(pe.codes), pe
        load_s = time.perf_counter() - t0
        probe = [key.format(i) for i in (0, n // 2, n - 1)]
        ex = rpc.call(lambda rid: P.ExistsReq(rid, probe))
        assert type(ex) is P.CodesResp and ex.codes == [1, 1, 1], ex
        rss = _rss_mib(cl.procs[1].pid)
        st = rpc.call(lambda rid: P.StatusReq(rid))
        lag = st.info.get("loop_lag_max_s") if type(st) is P.StatusResp else None
        rpc.close()

        def restart(crash: bool) -> float:
            if crash:
                cl.kill(1)  # the log since the last snapshot is replayed
            else:
                cl.stop(1, timeout=300)  # a graceful stop snapshots first
            t0 = time.perf_counter()
            cl.start(1, timeout=600)  # a 10 M-object replay can pass the 60 s default
            c = MasterClient([cl.address], name="bench-million-r", timeout=60)
            try:
                while True:
                    ex = c.call(lambda rid: P.ExistsReq(rid, probe))
                    if type(ex) is P.CodesResp and ex.codes == [1, 1, 1]:
                        return time.perf_counter() - t0
                    time.sleep(0.01)
            finally:
                c.close()

        crash_s = restart(True)
        restart_s = restart(False)
        rss_after = _rss_mib(cl.procs[1].pid)
    return [
        record(
            limits,
            "metadata",
            None,
            "restart",
            16384,
            batch,
            ops_per_s=n / load_s,
            objects=n,
            key_bytes=len(key.format(0)),
            rss_mib=round(rss, 1),
            rss_bytes_per_object=round((rss - rss_empty) * MiB / n, 1),
            rss_after_restart_mib=round(rss_after, 1),
            restart_s=round(restart_s, 3),
            restart_after_crash_s=round(crash_s, 3),
            loop_lag_max_s=lag,
            fsync=True,
        )
    ]


def failover(limits: dict, a: Any) -> list[dict[str, Any]]:
    """Kill -9 / restart rounds on 3 durable replicas (``bench/_failover.py``), once per event
    loop: the write pause a store client sees per leader kill (p50/p99 in the standard
    fields) and the restarted replicas' catch-up time, every acknowledged put verified."""
    from bench._failover import VALUE_BYTES, run_rounds, summary
    from kvmesh.net import eventloop

    rounds = a.failover_rounds or (6 if a.quick else 20)
    rows = []
    old = os.environ.get(eventloop.ENV)
    try:
        for loop in ("uvloop", "asyncio"):
            os.environ[eventloop.ENV] = loop
            try:
                eventloop.loop_name()
            except ValueError:
                continue  # uvloop not installed
            with tempfile.TemporaryDirectory() as d:
                sm = summary(run_rounds(d, rounds))
            rows.append(
                record(
                    limits, "failover", None, "put", VALUE_BYTES, 8,
                    p50_us=None if sm["pause_p50_s"] is None else sm["pause_p50_s"] * 1e6,
                    p99_us=None if sm["pause_p99_s"] is None else sm["pause_p99_s"] * 1e6,
                    event_loop=loop, rounds=sm["rounds"], kills=sm["kills"],
                    pause_max_s=sm["pause_max_s"], catchup_p50_s=sm["catchup_p50_s"],
                    catchup_p99_s=sm["catchup_p99_s"], catchup_max_s=sm["catchup_max_s"],
                    missed=sm["missed"], acked_keys=sm["acked"], lost_keys=sm["lost"],
                    tick_ms=sm["tick_ms"], election_ticks=sm["election_ticks"], fsync=True,
                )
            )  # fmt: skip
    finally:
        if old is None:
            os.environ.pop(eventloop.ENV, None)
        else:
            os.environ[eventloop.ENV] = old
    return rows


def _options(ap: Any) -> None:
    ap.add_argument("--shapes", default="", help="PAGExBATCH,... (default: the matrix)")
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions per case")
    ap.add_argument("--latency-samples", type=int, default=0)
    ap.add_argument("--meta-seconds", type=float, default=0.0, help="metadata case duration")
    ap.add_argument("--tcp-mib", type=int, default=512, help="bytes of the TCP reference stream")
    ap.add_argument(
        "--failover-rounds",
        type=int,
        default=0,
        help="kill/restart rounds per event loop of the failover case (default 20, --quick 6)",
    )
    ap.add_argument("--only-failover", action="store_true", help="run only the failover case")
    ap.add_argument(
        "--put-stages",
        type=int,
        default=0,
        metavar="N",
        help="also time the stages of N more puts per put row (client round trips, write, "
        "master CPU per put): printed and in the JSON rows as put_stages_us",
    )
    ap.add_argument(
        "--objects",
        type=int,
        default=0,
        help="objects of the large-master case (default 1,000,000; --quick skips the case "
        "unless this is given)",
    )


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--peer":
        peer_main(argv[1], int(argv[2]))
        return 0
    a = bench_args(__doc__.split("\n\n")[0], argv, extra=_options)
    t_start = time.monotonic()
    limits: dict[str, float | None] = {
        "memcpy_gbps": memcpy_gbps(),
        "copy_all_cores_gbps": copy_all_cores_gbps(),
        "tcp_gbps": tcp_gbps(total=a.tcp_mib * MiB),
    }
    rows: list[dict[str, Any]] = []
    if not a.only_failover:
        rows += data_path(limits, a, "cross-process", None)
        rows += data_path(limits, a, "network", "bench-other-host")
        rows += metadata(limits, a)
        if not a.quick or a.objects:
            rows += million(limits, a)
        if not a.quick:
            rows += ten_million(limits, a)
    rows += failover(limits, a)
    print(f"limits: {copy_limits_text(limits)}, loopback TCP {limits['tcp_gbps']:.2f} GB/s")
    for r in rows:
        if r["op"] == "restart":
            print(
                f"master with {r['objects']:,} objects: RSS {r['rss_mib']:.0f} MiB "
                f"({r['rss_bytes_per_object']:.0f} B/object, keys {r['key_bytes']} B) "
                f"({r['rss_after_restart_mib']:.0f} MiB after restart), restart "
                f"{r['restart_s']:.2f} s ({r['restart_after_crash_s']:.2f} s after kill -9), "
                f"loaded at {r['ops_per_s']:,.0f} keys/s, loop lag max {r['loop_lag_max_s']} s"
            )
        if r["case"] == "failover":
            sec = lambda v, k=1.0: "-" if v is None else f"{v / k:.2f}"  # noqa: E731
            print(
                f"failover ({r['event_loop']}, {r['rounds']} rounds, {r['kills']} leader kills): "
                f"write pause p50 {sec(r['p50_us'], 1e6)} s p99 {sec(r['p99_us'], 1e6)} s; "
                f"restarted replica catch-up p50 {sec(r['catchup_p50_s'])} s max "
                f"{sec(r['catchup_max_s'])} s; {r['missed']} rounds missed; "
                f"{r['lost_keys']} of {r['acked_keys']} acknowledged keys lost"
            )
    print_table(rows, [f for f in FIELDS if f != "ratio_tcp"])
    _print_put_stages(rows)
    print(f"done in {time.monotonic() - t_start:.0f} s")
    if a.json:
        write_json(a.json, "store", limits, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
