"""Node liveness against live processes (docs/store-master.md, "Node liveness"): a stopped
leader expires nobody when it continues, a flooded leader expires nobody, a node that
really died is still expired within its TTL plus one stage -- counted in the leader's
heard time, which the master reports in its status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvmesh.store import StoreClient
from kvmesh.store.cluster import StoreCluster

from .e2e_util import TOKEN, Peer
from .store_peer import value_of

TTL = 2.0  # node TTL of these masters (short: the tests wait a few TTLs)
STAGE = 1.0  # suspect stage
HEARTBEAT = 0.3  # the storage nodes' heartbeat interval
TICKER = 0.25  # the master's ticker (ServiceConfig.ticker_s)
ARGS = ["--node-ttl-s", str(TTL), "--node-suspect-s", str(STAGE)]
N_OBJ = 64
SIZE = 4096


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _leader_status(c: StoreClient, timeout: float = 30.0) -> dict:
    """The current leader's status. ``StoreClient.status`` answers from whichever replica
    the client talks to, and a follower's view lags the log: the checks here are of the
    leader's judgement (a follower's would also make "the leader" paused a follower)."""
    deadline = time.monotonic() + timeout
    while True:
        for addr in c.rpc.addrs:
            try:
                st = c.rpc.status(addr, timeout=2.0)
            except Exception:  # noqa: BLE001 - a paused or restarting replica
                continue
            if st.get("role") == "LEADER":
                return st
        if time.monotonic() > deadline:
            raise AssertionError("no replica answers as the leader")
        time.sleep(0.1)


def _heard(st: dict) -> float:
    return float(st.get("liveness", {}).get("heard_s", 0.0))


def _lost(st: dict, segment: str) -> str:
    """Why the pool no longer looks as it did (empty: nothing lost)."""
    names = [s["name"] for s in st["segments"]]
    if names != [segment]:
        return f"segments {names} (was [{segment!r}])"
    if st["objects"] != N_OBJ:
        return f"{st['objects']} objects (was {N_OBJ})"
    if st.get("liveness", {}).get("expired", 0):
        return f"{st['liveness']['expired']} nodes expired"
    return ""


def _fill(node: Peer) -> list[str]:
    keys = [f"obj-{i}" for i in range(N_OBJ)]
    r = node.call(op="put", keys=keys, sizes=[SIZE] * N_OBJ)
    assert r["codes"] == [0] * N_OBJ
    return keys


def _readable(node: Peer, keys: list[str]) -> None:
    import hashlib

    r = node.call(op="get", keys=keys)
    assert r["codes"] == [0] * len(keys)
    want = [hashlib.sha256(value_of(k, SIZE)).hexdigest() for k in keys]
    assert r["sha"] == want, "objects read back differ from what was put"


def _stop_leader_and_check(cl: StoreCluster, leader: int, node: Peer, c: StoreClient) -> None:
    keys = _fill(node)
    st = _leader_status(c)
    segment = st["segments"][0]["name"]
    assert _lost(st, segment) == ""
    cl.pause(leader)
    try:
        # Two TTLs on the clock; the master gets no CPU at all meanwhile.
        time.sleep(2 * TTL)
    finally:
        cl.resume(leader)
    # From the first status after the pause, wait until a node silent since the pause
    # would have been expired (TTL + stage of heard time, plus a ticker turn) -- or
    # until something is lost, which fails at once.
    resumed = _heard(_leader_status(c))
    state: dict = {}

    def settled() -> bool:
        st = state["st"] = _leader_status(c)
        return bool(_lost(st, segment)) or _heard(st) >= resumed + TTL + STAGE + 2 * TICKER

    _wait(settled, 60, "the leader's heard time to pass TTL + stage after the pause")
    assert _lost(state["st"], segment) == "", "a stalled leader expired a live node"
    _readable(node, keys)


def test_stopped_single_replica_expires_no_node(tmp_path):
    """The issue's reproduction: one replica, 64 objects, the master stopped for 2x the
    node TTL and continued. Before the liveness judge every object was dropped."""
    with StoreCluster(str(tmp_path), 1, token=TOKEN, durability="memory", extra_args=ARGS) as cl:
        cl.start_all()
        node = Peer(cl.address, 8 << 20, env={"E2E_HEARTBEAT_S": str(HEARTBEAT)})
        c = StoreClient(cl.address, token=TOKEN, timeout=30)
        try:
            _stop_leader_and_check(cl, 1, node, c)
        finally:
            node.close()
            c.close()


def test_stopped_leader_of_three_expires_no_node(tmp_path):
    """Three replicas: the stopped leader is replaced, the new one gives every node a full
    TTL, and the old one, continuing, must not act on its stale view either."""
    with StoreCluster(str(tmp_path), 3, token=TOKEN, durability="memory", extra_args=ARGS) as cl:
        cl.start_all()
        node = Peer(cl.address, 8 << 20, env={"E2E_HEARTBEAT_S": str(HEARTBEAT)})
        c = StoreClient(cl.address, token=TOKEN, timeout=30)
        try:
            leader = int(_leader_status(c)["node_id"])
            _stop_leader_and_check(cl, leader, node, c)
        finally:
            node.close()
            c.close()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _flood(seconds: float, tmp_path) -> None:
    with StoreCluster(str(tmp_path), 1, token=TOKEN, durability="memory", extra_args=ARGS) as cl:
        cl.start_all()
        node = Peer(cl.address, 64 << 20, env={"E2E_HEARTBEAT_S": str(HEARTBEAT)})
        c = StoreClient(cl.address, token=TOKEN, timeout=30)
        floods: list[subprocess.Popen] = []
        try:
            keys = _fill(node)
            segment = _leader_status(c)["segments"][0]["name"]
            env = dict(os.environ, E2E_STORE_TOKEN=TOKEN)
            pid = cl.procs[1].pid
            cpu0, t0 = _cpu_s(pid), time.monotonic()
            floods = [
                subprocess.Popen(
                    [sys.executable, "-m", "tests.store.flood_peer", cl.address, str(seconds), "4"],
                    stdout=subprocess.PIPE,
                    env=env,
                )
                for _ in range(2)
            ]
            outs = [json.loads(p.communicate(timeout=seconds + 120)[0]) for p in floods]
            cpu = (_cpu_s(pid) - cpu0) / (time.monotonic() - t0)
            done = sum(o["requests"] for o in outs)
            print(f"flood: {done} requests, master CPU {cpu:.2f} cores")
            assert done > 0 and not any(o["errors"] for o in outs), outs
            st = _leader_status(c)
            assert _lost(st, segment) == "", "a flooded leader expired a live node"
            _readable(node, keys)
        finally:
            for p in floods:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            node.close()
            c.close()


def test_flooded_leader_expires_no_node(tmp_path):
    # Twice TTL + stage: a heartbeat the flood held back that long would have expired the
    # node (the minute-long run is the slow variant below).
    _flood(2 * (TTL + STAGE) + 2.0, tmp_path)


@pytest.mark.slow
def test_flooded_leader_expires_no_node_for_a_minute(tmp_path):
    _flood(60.0, tmp_path)


def test_killed_node_is_expired_within_ttl_and_a_stage(tmp_path):
    with StoreCluster(str(tmp_path), 1, token=TOKEN, durability="memory", extra_args=ARGS) as cl:
        cl.start_all()
        node = Peer(cl.address, 8 << 20, env={"E2E_HEARTBEAT_S": str(HEARTBEAT)})
        c = StoreClient(cl.address, token=TOKEN, timeout=30)
        try:
            _fill(node)
            before = _heard(_leader_status(c))  # the node's last heartbeat is at most this
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait()
            _wait(lambda: _leader_status(c)["segments"] == [], 60, "the dead node's expiry")
            st = _leader_status(c)
            assert st["objects"] == 0
            took = st["liveness"]["last_expiry_heard_s"] - before
            # expiry at the first ticker turn past TTL + stage after its last heartbeat;
            # no sooner than TTL + stage after the last heartbeat before the kill
            assert TTL + STAGE - 1.0 <= took <= TTL + STAGE + 2 * TICKER, took
        finally:
            node.close()
            c.close()
