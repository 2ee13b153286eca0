"""Bounds of the exactly-once session table (defects found by attacking a live store
master): live sessions are capped with least-recently-used expiry, and unacknowledged
cached results are bounded in bytes per session and in total. Every decision is taken
inside ``apply`` from committed entries only, so replicas and restored snapshots agree."""

from __future__ import annotations

import random

import msgspec
import pytest

from kvmesh.replog.errors import ERROR_CODES, ResultEvicted, SessionExpiredError
from kvmesh.replog.kvsm import KvGet, KvPut, KvStateMachine, encode_command
from kvmesh.replog.session import (
    RESULT_OVERHEAD,
    Command,
    Expire,
    Register,
    SessionLimits,
    SessionRejected,
    SessionStateMachine,
    SessionTracker,
    encode_envelope,
)


def _digest(sm: SessionStateMachine) -> bytes:
    """The whole replicated state, session LRU order and limits included."""
    table = [
        (cid, s.floor, s.evicted, s.last, s.token, s.results) for cid, s in sm.sessions.items()
    ]
    return msgspec.msgpack.encode([table, sm.limits, sorted(sm.inner.data.items())])


def _cmd(cid: int, seq: int, c, ack: int = 0) -> bytes:
    return encode_envelope(Command(cid, seq, encode_command(c), ack))


def _reg(**limits) -> bytes:
    return encode_envelope(Register(b"", **limits))


def _sm() -> SessionStateMachine:
    return SessionStateMachine(KvStateMachine())


def test_full_table_expires_the_least_recently_used_session():
    sm = _sm()
    sm.apply(1, _reg(max_sessions=3))
    sm.apply(2, _reg())
    sm.apply(3, _reg())
    assert sm.limits.max_sessions == 3 and list(sm.sessions) == [1, 2, 3]
    sm.apply(4, _cmd(1, 1, KvPut("a", b"1")))  # session 1 used: 2 is now the oldest
    assert sm.apply(5, _reg()) == 5
    assert list(sm.sessions) == [3, 1, 5] and sm.sessions_evicted == 1
    assert sm.apply(6, _cmd(2, 1, KvPut("b", b"x"))) == SessionRejected(2, 1, "unknown_session")
    assert sm.inner.get("b") is None
    # A duplicate answered from the cache is a use too.
    assert sm.apply(7, _cmd(1, 1, KvPut("a", b"1"))) is None and sm.duplicates == 1
    assert list(sm.sessions) == [3, 5, 1]
    sm.apply(8, _reg())
    assert list(sm.sessions) == [5, 1, 8]
    # A rejected foreign command is not a use: it must not keep another's session alive.
    sm.apply(9, encode_envelope(Register(b"secret")))
    assert list(sm.sessions) == [1, 8, 9]
    bad = encode_envelope(Command(9, 1, encode_command(KvPut("z", b"z")), 0, b"wrong"))
    assert sm.apply(10, bad) == SessionRejected(9, 1, "bad_token")
    assert sm.sessions[9].last == 9
    # Register entries without limits keep those in force; later ones may change them.
    sm.apply(11, _reg(max_sessions=2))
    assert list(sm.sessions) == [9, 11] and sm.sessions_evicted == 5


def test_many_registrations_stay_bounded_and_expire_cleans_up():
    sm = _sm()
    sm.apply(1, _reg(max_sessions=100))
    for i in range(2, 5001):
        sm.apply(i, _reg())
    assert len(sm.sessions) == 100 and list(sm.sessions) == list(range(4901, 5001))
    sm.apply(5001, encode_envelope(Expire([4901, 4902, 77])))
    assert len(sm.sessions) == 98


def test_unacknowledged_results_are_bounded_in_bytes_per_session():
    sm = _sm()
    sm.apply(1, _reg(max_result_bytes=10_000))
    big = b"v" * 3000
    for seq in range(1, 4):
        sm.apply(1 + seq, _cmd(1, seq, KvPut(f"k{seq}", big)))
    # Results of gets carry the value: the 4th ~3 KB one goes beyond 10 KB, so the oldest
    # results are evicted (apply order) until the session fits again.
    for seq in range(4, 8):
        assert sm.apply(1 + seq, _cmd(1, seq, KvGet(f"k{1 + seq % 3}"))) == big
    s = sm.sessions[1]
    assert sum(len(r) + RESULT_OVERHEAD for r in s.results.values()) <= 10_000
    assert sm.result_bytes <= 10_000 and s.evicted == 5 and sorted(s.results) == [5, 6, 7]
    assert sm.results_evicted == 4
    # The retry of an evicted result gets a specific answer and is not applied again.
    sm.apply(20, _cmd(1, 99, KvPut("k1", b"changed")))
    r = sm.apply(21, _cmd(1, 4, KvGet("k1")))
    assert r == SessionRejected(1, 4, "result_evicted")
    r = sm.apply(22, _cmd(1, 2, KvPut("k2", b"again")))
    assert r == SessionRejected(1, 2, "result_evicted") and sm.inner.get("k2") == big
    # Cached results below the eviction point are still answered from the cache.
    assert sm.apply(23, _cmd(1, 6, KvGet("k3"))) == big and sm.duplicates == 1
    # Acknowledged seqs stay "stale_seq" (the client has their results).
    sm.apply(24, _cmd(1, 100, KvGet("k1"), ack=100))
    assert sm.apply(25, _cmd(1, 50, KvGet("k1"))) == SessionRejected(1, 50, "stale_seq")
    assert sm.result_bytes == len(sm.sessions[1].results[100]) + RESULT_OVERHEAD


def test_cached_results_are_bounded_in_total_least_recently_used_first():
    sm = _sm()
    sm.apply(1, _reg(max_result_bytes=50_000, max_result_bytes_total=20_000))
    sm.apply(2, _reg())
    sm.apply(3, _reg())
    sm.apply(4, _cmd(1, 1, KvPut("x", b"v" * 6000)))
    for i, cid in enumerate((1, 2, 3)):
        assert sm.apply(5 + i, _cmd(cid, 2, KvGet("x"))) == b"v" * 6000
    assert sm.result_bytes <= 20_000
    sm.apply(8, _cmd(3, 3, KvGet("x")))  # session 1 is the LRU holder: all its results go
    assert sm.sessions[1].results == {} and sm.sessions[1].evicted == 3
    assert sorted(sm.sessions[2].results) == [2] and sorted(sm.sessions[3].results) == [2, 3]
    assert sm.result_bytes <= 20_000
    assert sm.apply(9, _cmd(1, 2, KvGet("x"))) == SessionRejected(1, 2, "result_evicted")


def _random_log(rng: random.Random, n: int) -> list[bytes]:
    """Registrations, pipelined commands with retries and acks, expiries, under small
    limits so that every bound triggers often."""
    out = [_reg(max_sessions=6, max_results=5, max_result_bytes=2000, max_result_bytes_total=6000)]
    cids: list[int] = []
    seqs: dict[int, int] = {}
    for _ in range(n):
        idx = len(out) + 1
        r = rng.random()
        if r < 0.08 or not cids:
            cids.append(idx)
            seqs[idx] = 0
            out.append(_reg())
        elif r < 0.1:
            out.append(encode_envelope(Expire([rng.choice(cids)])))
        else:
            cid = rng.choice(cids[-10:])
            if rng.random() < 0.25 and seqs[cid]:
                seq = rng.randint(max(1, seqs[cid] - 8), seqs[cid])  # a retry
            else:
                seqs[cid] += 1
                seq = seqs[cid]
            key = f"k{rng.randrange(8)}"
            c = KvPut(key, b"x" * rng.randrange(1, 900)) if rng.random() < 0.5 else KvGet(key)
            ack = max(0, seq - rng.randrange(0, 12)) if rng.random() < 0.3 else 0
            out.append(_cmd(cid, seq, c, ack))
    return out


def test_replicas_and_restored_snapshots_agree_under_every_bound():
    rng = random.Random(20261130)
    log = _random_log(rng, 3000)
    a, b = _sm(), _sm()
    restored: SessionStateMachine | None = None
    results_a = []
    for i, data in enumerate(log, 1):
        results_a.append(a.apply(i, data))
        b.apply(i, data)
        if i % 500 == 0:
            # A replica that restores a snapshot here must continue identically: same LRU
            # order, limits, eviction points and byte accounting.
            restored = _sm()
            restored.restore(b.snapshot())
            assert _digest(restored) == _digest(a)
            assert restored.result_bytes == a.result_bytes
            b = restored
        assert _digest(a) == _digest(b)
    assert a.sessions_evicted > 10 and a.results_evicted > 50 and a.duplicates > 10
    assert any(
        r == SessionRejected(r.client_id, r.seq, "result_evicted")
        for r in results_a
        if isinstance(r, SessionRejected)
    )
    assert len(a.sessions) <= 6 and a.result_bytes <= 6000
    # Byte accounting matches the table.
    assert a.result_bytes == sum(
        len(r) + RESULT_OVERHEAD for s in a.sessions.values() for r in s.results.values()
    )


def test_restore_rebuilds_lru_order_from_the_log_clock():
    sm = _sm()
    sm.apply(1, _reg(max_sessions=3))
    sm.apply(2, _reg())
    sm.apply(3, _reg())
    sm.apply(4, _cmd(1, 1, KvPut("a", b"1")))
    r = _sm()
    r.restore(sm.snapshot())
    assert list(r.sessions) == [2, 3, 1] and r.limits.max_sessions == 3
    r.apply(5, _reg())
    sm.apply(5, _reg())
    assert list(r.sessions) == list(sm.sessions) == [3, 1, 5]


def test_old_snapshot_and_register_formats_still_decode():
    # A session table written before the limits existed: three fields per session, no limits.
    old = msgspec.msgpack.encode([{7: [0, {1: b"\xc0"}, b"t"]}])
    from kvmesh.replog.session import _table_dec

    t = _table_dec.decode(old)
    assert t.limits == SessionLimits() and t.sessions[7].last == 0
    assert msgspec.msgpack.decode(encode_envelope(Register(b"t")))[:2] == ["reg", b"t"]


def test_result_evicted_is_a_specific_wire_error():
    assert ERROR_CODES["result_evicted"] is ResultEvicted
    assert issubclass(ResultEvicted, SessionExpiredError)  # callers handling "session" still do


def test_leader_tracker_is_bounded():
    t = SessionTracker(ttl_s=10, max_entries=100)
    for cid in range(10_000):
        t.touch(cid, 100.0 + cid / 1000)
    assert len(t._last) == 100
    assert t.idle(200.0, limit=5) == [9900, 9901, 9902, 9903, 9904]


@pytest.mark.parametrize(
    "field", ["max_sessions", "max_results", "max_result_bytes", "max_result_bytes_total"]
)
def test_node_config_refuses_non_positive_limits(field):
    from kvmesh.replog.node import NodeConfig

    with pytest.raises(ValueError):
        NodeConfig(
            node_id=1,
            peers={1: "127.0.0.1:1"},
            durability="memory",
            session_limits=SessionLimits(**{field: 0}),
        )
