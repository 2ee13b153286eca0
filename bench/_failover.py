"""Kill-and-restart rounds against a live store master group (issue 16), shared by the
``failover`` case of ``bench/store.py`` and ``tests/store/test_e2e_failover.py``.

Three ``kvmesh.store.service`` replicas (``--durability disk``) on loopback, a storage node in
its own process (``tests.store.store_peer``) and a writer thread in this process putting 8
keys of 1 KiB per call, back to back. Rounds alternate: kill -9 a follower, or kill -9 the
leader; then start the killed replica again. Per round:

* ``pause_s`` (leader kills): from the kill to the acknowledgement of the first put the
  writer *issued after* the kill -- the write pause a store client sees;
* ``catchup_s``: from the restarted replica's READY to its commit index reaching the
  leader's commit index as it was at that READY (the stuck-replica bug of issue 16 never
  gets there);
* ``leader_s`` (leader kills): from the kill to a replica other than the victim reporting
  itself leader.

Every acknowledged key is read back byte-exact at the end (``lost`` counts the others).
``KVMESH_EVENT_LOOP`` (``kvmesh.net.eventloop``) picks the replicas' event loop.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from kvmesh.net import eventloop
from kvmesh.store import StoreClient
from kvmesh.store import errors as E
from kvmesh.store.cluster import StoreCluster

VALUE_BYTES = 1024
TOKEN = "failover-rounds-token"


def _value(key: str) -> bytes:
    from tests.store.store_peer import value_of

    return value_of(key, VALUE_BYTES)


class _Writer(threading.Thread):
    """Back-to-back puts of 8 keys; records (issued, acked) monotonic times per call."""

    def __init__(self, client: StoreClient) -> None:
        super().__init__(name="failover-writer", daemon=True)
        self.client = client
        self.stop = threading.Event()
        self.acked: list[str] = []
        self.failed = 0
        self.calls: list[tuple[float, float]] = []  # (issued, acked) of acknowledged calls
        self._lock = threading.Lock()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            keys = [f"fo-{i}-{j}" for j in range(8)]
            i += 1
            t0 = time.monotonic()
            try:
                res = self.client.put(keys, [_value(k) for k in keys])
            except E.StoreError:
                self.failed += len(keys)
                continue
            t1 = time.monotonic()
            ok = [k for k, r in zip(keys, res) if not isinstance(r, E.StoreError)]
            self.failed += len(keys) - len(ok)
            with self._lock:
                self.acked.extend(ok)
                if ok:
                    self.calls.append((t0, t1))

    def first_ack_issued_after(self, t: float, timeout: float) -> float | None:
        """The ack time of the first call issued after ``t`` (waits up to ``timeout``)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                first = None
                for issued, acked in reversed(self.calls):
                    if issued < t:
                        break
                    first = acked
            if first is not None:
                return first
            time.sleep(0.005)
        return None


def _status(rpc: Any, addr: str) -> dict[str, Any] | None:
    try:
        return rpc.status(addr, timeout=1.0)
    except (E.StoreError, OSError):
        return None


def _leader(cl: StoreCluster, rpc: Any, exclude: int = 0, timeout: float = 30.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for i in cl.ids:
            if i == exclude or not cl.alive(i):
                continue
            st = _status(rpc, cl.addrs[i])
            if st and st.get("role") == "LEADER":
                return i
        time.sleep(0.01)
    raise TimeoutError("no leader")


def _commit(rpc: Any, cl: StoreCluster, i: int) -> int:
    st = _status(rpc, cl.addrs[i])
    return int(st.get("commit", -1)) if st else -1


def _catch_up(cl: StoreCluster, rpc: Any, i: int, limit_s: float) -> float | None:
    """Seconds until replica ``i``'s commit reaches the leader's (as of now), or None."""
    t0 = time.monotonic()
    lead = _leader(cl, rpc, timeout=limit_s)
    target = _commit(rpc, cl, lead)
    while time.monotonic() - t0 < limit_s:
        if _commit(rpc, cl, i) >= target >= 0:
            return time.monotonic() - t0
        time.sleep(0.01)
    return None


def run_rounds(
    base_dir: str,
    rounds: int,
    *,
    catchup_limit_s: float = 10.0,
    pause_limit_s: float = 30.0,
    tick_ms: float | None = None,
    election_ticks: int | None = None,
    extra_args: list[str] | None = None,
) -> dict[str, Any]:
    """``rounds`` kill/restart rounds (even: a follower, odd: the leader); see the module
    docstring. Returns ``{"loop", "rounds": [{kind, victim, pause_s, leader_s, catchup_s}],
    "acked", "failed", "lost"}``; a round that missed a limit has None in that field.
    ``tick_ms``/``election_ticks``: the replicas' (default: ``ServiceConfig``'s defaults, what
    a master started without those options runs with)."""
    from kvmesh.store.service import ServiceConfig
    from tests.store.e2e_util import Peer

    dflt = ServiceConfig()
    tick_ms = dflt.tick_s * 1000.0 if tick_ms is None else tick_ms
    election_ticks = dflt.election_ticks if election_ticks is None else election_ticks
    out: dict[str, Any] = {
        "loop": eventloop.loop_name(),
        "rounds": [],
        "tick_ms": tick_ms,
        "election_ticks": election_ticks,
    }
    with StoreCluster(
        base_dir,
        3,
        token=TOKEN,
        durability="disk",
        tick_ms=tick_ms,
        election_ticks=election_ticks,
        extra_args=extra_args,
    ) as cl:
        cl.start_all()
        peer = Peer(cl.address, 256 << 20, token=TOKEN)  # no eviction in 20 rounds
        client = StoreClient(cl.address, token=TOKEN, timeout=30)
        w = _Writer(client)
        try:
            probe = client.rpc
            _leader(cl, probe)
            w.start()
            while len(w.acked) < 64:  # writes flow before the first kill
                time.sleep(0.01)
            for r in range(rounds):
                lead = _leader(cl, probe)
                kind = "leader" if r % 2 else "follower"
                victim = lead if kind == "leader" else next(i for i in cl.ids if i != lead)
                row: dict[str, Any] = {"kind": kind, "victim": victim}
                t_kill = time.monotonic()
                row["t_kill"] = round(t_kill, 3)
                cl.kill(victim)
                out["rounds"].append(row)
                if kind == "leader":
                    try:
                        row["new_leader"] = _leader(cl, probe, victim, pause_limit_s)
                    except TimeoutError:
                        row["leader_s"] = row["pause_s"] = row["catchup_s"] = None
                        break  # the cluster is stuck (issue 16); no later round means much
                    row["leader_s"] = time.monotonic() - t_kill
                    acked = w.first_ack_issued_after(t_kill, pause_limit_s)
                    row["pause_s"] = None if acked is None else acked - t_kill
                else:
                    n = len(w.acked)
                    while len(w.acked) < n + 16 and time.monotonic() - t_kill < pause_limit_s:
                        time.sleep(0.005)
                cl.start(victim)
                try:
                    row["catchup_s"] = _catch_up(cl, probe, victim, catchup_limit_s)
                except TimeoutError:
                    row["catchup_s"] = None
        finally:
            w.stop.set()
            w.join(60)
            out["acked"] = len(w.acked)
            out["failed"] = w.failed
            lost: int | None = 0
            check = StoreClient(cl.address, token=TOKEN, timeout=30)
            try:
                for s in range(0, len(w.acked), 512):
                    keys = w.acked[s : s + 512]
                    got = check.get(keys)
                    bad = [(k, v) for k, v in zip(keys, got) if v != _value(k)]
                    lost += len(bad)  # type: ignore[operator]
                    out.setdefault("lost_examples", []).extend(
                        f"{k}: {v!r:.200}" for k, v in bad[: 5 - len(out.get("lost_examples", []))]
                    )
            except E.StoreError:
                lost = None  # not checked: no master answers (a stuck cluster)
            finally:
                check.close()
                client.close()
                peer.close()
            out["lost"] = lost
            out["logs"] = {i: cl.log_tail(i, 1500) for i in cl.ids}
    return out


def summary(out: dict[str, Any]) -> dict[str, Any]:
    """p50/p99/max of the leader-kill pauses and of all catch-ups (seconds)."""

    def pct(xs: list[float], q: float) -> float | None:
        if not xs:
            return None
        xs = sorted(xs)
        return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]

    pauses = [r["pause_s"] for r in out["rounds"] if r.get("pause_s") is not None]
    catch = [r["catchup_s"] for r in out["rounds"] if r.get("catchup_s") is not None]
    return {
        "loop": out["loop"],
        "tick_ms": out.get("tick_ms"),
        "election_ticks": out.get("election_ticks"),
        "kills": sum(1 for r in out["rounds"] if r["kind"] == "leader"),
        "rounds": len(out["rounds"]),
        "pause_p50_s": pct(pauses, 50),
        "pause_p99_s": pct(pauses, 99),
        "pause_max_s": max(pauses, default=None),
        "catchup_p50_s": pct(catch, 50),
        "catchup_p99_s": pct(catch, 99),
        "catchup_max_s": max(catch, default=None),
        "missed": sum(
            1
            for r in out["rounds"]
            if r.get("catchup_s") is None or (r["kind"] == "leader" and r.get("pause_s") is None)
        ),
        "acked": out["acked"],
        "lost": out["lost"],
    }


if __name__ == "__main__":  # a quick look (arguments below)
    import json
    import sys
    import tempfile

    # python -m bench._failover [ROUNDS [TICK_MS [ELECTION_TICKS]]]
    args = sys.argv[1:]
    with tempfile.TemporaryDirectory() as d:
        res = run_rounds(
            d,
            int(args[0]) if args else 6,
            tick_ms=float(args[1]) if len(args) > 1 else None,
            election_ticks=int(args[2]) if len(args) > 2 else None,
        )
    for row in res["rounds"]:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    print(json.dumps(summary(res)), os.environ.get(eventloop.ENV, ""))
