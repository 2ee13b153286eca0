"""End to end: a 3-replica master group (real processes, durable) loses its leader under
put/get load; no acknowledged put is lost and the clients carry on."""

from __future__ import annotations

import threading
import time

import pytest

from kvmesh.store import StoreClient
from kvmesh.store import errors as E
from kvmesh.store.cluster import StoreCluster

from ..event_loops import loop_name  # noqa: F401 - a fixture (usefixtures)
from .e2e_util import TOKEN, Peer
from .store_peer import value_of


def _leader(cl: StoreCluster, c: StoreClient) -> int:
    st = c.status()
    assert st["role"] == "LEADER"
    return int(st["node_id"])


@pytest.mark.timeout(180)
def test_leader_killed_under_load_loses_no_acknowledged_put(tmp_path):
    with StoreCluster(str(tmp_path), 3, token=TOKEN) as cl:
        cl.start_all()
        peer = Peer(cl.address, 64 << 20)  # the storage node, in its own process
        writer = StoreClient(cl.address, token=TOKEN, timeout=20)
        reader = StoreClient(cl.address, token=TOKEN, timeout=20)
        acked: list[str] = []
        failed: list[str] = []
        read_errors: list[str] = []
        stop = threading.Event()

        def write_loop() -> None:
            i = 0
            while not stop.is_set():
                keys = [f"fo-{i}-{j}" for j in range(8)]
                i += 1
                try:
                    res = writer.put(keys, [value_of(k, 4096) for k in keys])
                except E.StoreError:
                    failed.extend(keys)
                    continue
                for k, r in zip(keys, res):
                    (failed if isinstance(r, E.StoreError) else acked).append(k)

        def read_loop() -> None:
            while not stop.is_set():
                if len(acked) < 8:
                    time.sleep(0.01)
                    continue
                keys = acked[-8:]
                try:
                    res = reader.get(keys)
                except E.StoreError as e:
                    read_errors.append(repr(e))
                    continue
                for k, r in zip(keys, res):
                    if isinstance(r, bytes) and r != value_of(k, 4096):
                        read_errors.append(f"wrong bytes for {k}")

        threads = [threading.Thread(target=write_loop), threading.Thread(target=read_loop)]
        for t in threads:
            t.start()

        def until_acked(n: int, since: float) -> None:  # progress, not a fixed sleep
            while len(acked) < n and time.monotonic() - since < 30:
                time.sleep(0.05)

        try:
            until_acked(400, time.monotonic())  # the load runs, reads included
            before = len(acked)
            lead = _leader(cl, reader)
            cl.kill(lead)
            t_kill = time.monotonic()
            until_acked(before + 200, t_kill)
            assert len(acked) >= before + 200, "writes did not resume after the leader was killed"
            new_lead = _leader(cl, reader)
            assert new_lead != lead
            cl.start(lead)  # the old leader comes back as a follower
            until_acked(len(acked) + 200, time.monotonic())  # and the load goes on
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not [e for e in read_errors if e.startswith("wrong bytes")], read_errors[:5]
        # Every acknowledged put is still there, byte-exact (read from a fresh client).
        check = StoreClient(cl.address, token=TOKEN, timeout=20)
        try:
            for s in range(0, len(acked), 512):
                keys = acked[s : s + 512]
                got = check.get(keys)
                bad = [k for k, r in zip(keys, got) if r != value_of(k, 4096)]
                assert not bad, (
                    f"{len(bad)} acknowledged puts lost, e.g. {bad[:3]}: "
                    f"{got[keys.index(bad[0])]!r}"
                )
        finally:
            check.close()
            writer.close()
            reader.close()
            peer.close()
        assert len(acked) > 200


GRACE_S = 20.0  # the lease TTL, so the new leader's grace period outlasts the test's calls


@pytest.mark.timeout(180)
def test_a_new_leader_does_not_wait_out_its_grace_for_its_own_keys(tmp_path):
    """Issue 20 item 6: a new leader answered ObjectHasLease for upserts and removes of
    keys created under itself for a whole lease period. Now only objects an earlier leader
    may have leased wait: an old key read (leased) under the killed leader still answers
    ObjectHasLease, while a key put under the new leader is upserted and removed at once."""
    args = ["--lease-ttl-s", str(GRACE_S)]
    with StoreCluster(str(tmp_path), 3, token=TOKEN, extra_args=args) as cl:
        cl.start_all()
        peer = Peer(cl.address, 16 << 20)
        c = StoreClient(cl.address, token=TOKEN, timeout=30)
        try:
            assert c.put("old", b"o" * 64) is None
            assert c.get("old") == b"o" * 64  # leased by the first leader
            first = _leader(cl, c)
            cl.kill(first)
            assert c.put("new", b"n" * 64) is None  # under the new leader
            assert _leader(cl, c) != first
            t0 = time.monotonic()
            with pytest.raises(E.ObjectHasLease):
                c.remove("old")  # the old leader's lease may still run: the grace holds
            assert c.upsert("new", b"N" * 64) is None
            assert c.get("new") == b"N" * 64  # (now leased by the new leader itself)
            with pytest.raises(E.ObjectHasLease):
                c.remove("new")
            assert c.remove("new", force=True) is None
            assert c.put("new2", b"x" * 64) is None
            assert c.remove("new2") is None
            assert c.put("new2", b"y" * 64) is None  # remove + recreate in the same term
            assert c.upsert("new2", b"z" * 64) is None
            assert c.get("new2") == b"z" * 64
            assert time.monotonic() - t0 < GRACE_S / 2  # all of it inside the grace period
        finally:
            c.close()
            peer.close()


# Restarted replicas and repeated leader kills on both event loops (issue 16): under uvloop a
# write to a connection the peer reset raised RuntimeError, which ended the raft sender
# towards that peer for good, so a restarted replica stayed cut off (PRE_CANDIDATE) and the
# next leader kill left no quorum that could elect (writes stalled for 60 s and more).
CATCHUP_S = 2.0  # a restarted replica's commit reaches the leader's within this (issue 16)
# The longest write pause after a leader kill that still counts as a failover: the election
# timeout here is 0.5-1.0 s (50 ms ticks), so this is several elections long; the stuck
# cluster of issue 16 never resumes at all.
FAILOVER_BOUND_S = 10.0


def _check_rounds(res, rounds):
    from bench._failover import summary

    rows = res["rounds"]
    info = f"{summary(res)}; rounds {rows}; logs {res['logs']}"
    assert len(rows) == rounds, f"stopped after {len(rows)} of {rounds} rounds: {info}"
    for r in rows:
        if r["kind"] == "leader":
            assert r["pause_s"] is not None and r["pause_s"] < FAILOVER_BOUND_S, info
        assert r["catchup_s"] is not None and r["catchup_s"] < CATCHUP_S, info
    assert res["lost"] == 0, info  # every acknowledged put is still there, byte-exact
    assert res["acked"] > 0


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("loop_name")
def test_replicas_restart_and_leaders_fail_over_on_both_event_loops(tmp_path):
    """Kill -9 a follower, then the leader, three times, restarting each: every restarted replica
    catches up, every leader kill is followed by a commit, no acknowledged put is lost."""
    from bench._failover import run_rounds

    _check_rounds(run_rounds(str(tmp_path), 6, catchup_limit_s=CATCHUP_S + 1), 6)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("loop_name")
def test_failover_soak_20_rounds(tmp_path):
    from bench._failover import run_rounds

    _check_rounds(run_rounds(str(tmp_path), 20, catchup_limit_s=CATCHUP_S + 1), 20)
