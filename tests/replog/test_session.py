"""Exactly-once sessions around a state machine: duplicates, pipelining, expiry through the
log, snapshot/restore of the session table, and replica determinism."""

import pytest

from kvmesh.replog.kvsm import KvCas, KvDelete, KvGet, KvPut, KvStateMachine, encode_command
from kvmesh.replog.session import (
    Command,
    Expire,
    Plain,
    Register,
    SessionRejected,
    SessionStateMachine,
    SessionTracker,
    decode_envelope,
    encode_envelope,
)
from kvmesh.replog.storage.snapfile import SnapshotCorruptionError
from kvmesh.replog.types import StateMachine


class Log:
    """Feeds envelopes to a machine with increasing indexes, like committed entries."""

    def __init__(self, sm):
        self.sm = sm
        self.index = 0

    def apply(self, env):
        self.index += 1
        return self.sm.apply(self.index, encode_envelope(env))


def cmd(cid, seq, c, ack=0):
    return Command(cid, seq, encode_command(c), ack)


def test_protocol_and_envelope_roundtrip():
    sm = SessionStateMachine(KvStateMachine())
    assert isinstance(sm, StateMachine)
    for env in [Register(), Command(5, 2, b"x", 1), Expire([1, 2]), Plain(b"y")]:
        assert decode_envelope(encode_envelope(env)) == env


def test_duplicate_command_returns_cached_result_and_applies_once():
    sm = SessionStateMachine(KvStateMachine())
    log = Log(sm)
    cid = log.apply(Register())
    assert cid == 1
    assert log.apply(cmd(cid, 1, KvCas("k", None, b"a"))) is True
    # A retry of the same (client, seq) arrives after another client changed the key:
    log.apply(Plain(encode_command(KvDelete("k"))))
    assert log.apply(cmd(cid, 1, KvCas("k", None, b"a"))) is True  # cached: not re-applied
    assert sm.inner.get("k") is None  # the retry did not write again
    assert sm.duplicates == 1
    # A new seq is applied normally.
    assert log.apply(cmd(cid, 2, KvCas("k", None, b"b"))) is True
    assert sm.inner.get("k") == b"b"


def test_retried_get_and_delete_results_identical():
    sm = SessionStateMachine(KvStateMachine())
    log = Log(sm)
    cid = log.apply(Register())
    log.apply(cmd(cid, 1, KvPut("k", b"v1")))
    r1 = log.apply(cmd(cid, 2, KvGet("k")))
    log.apply(cmd(cid, 3, KvPut("k", b"v2")))
    assert log.apply(cmd(cid, 2, KvGet("k"))) == r1 == b"v1"
    assert log.apply(cmd(cid, 4, KvDelete("k"))) is True
    assert log.apply(cmd(cid, 4, KvDelete("k"))) is True  # the original answer, not False
    assert log.apply(cmd(cid, 5, KvDelete("k"))) is False


def test_pipelined_out_of_order_seqs_and_ack_pruning():
    sm = SessionStateMachine(KvStateMachine())
    log = Log(sm)
    cid = log.apply(Register())
    # Seqs 1..3 in flight concurrently; they commit out of order.
    log.apply(cmd(cid, 3, KvPut("c", b"3")))
    log.apply(cmd(cid, 1, KvPut("a", b"1")))
    log.apply(cmd(cid, 2, KvPut("b", b"2")))
    assert {k: sm.inner.get(k) for k in "abc"} == {"a": b"1", "b": b"2", "c": b"3"}
    assert sorted(sm.sessions[cid].results) == [1, 2, 3]
    # The client has the replies to 1..3 and says so with ack=4 on its next command.
    log.apply(cmd(cid, 4, KvPut("d", b"4"), ack=4))
    assert sorted(sm.sessions[cid].results) == [4]
    # A very late duplicate of seq 2 is refused, not re-applied.
    r = log.apply(cmd(cid, 2, KvPut("b", b"2")))
    assert r == SessionRejected(cid, 2, "stale_seq")


def test_unknown_and_expired_sessions_are_rejected_not_applied():
    sm = SessionStateMachine(KvStateMachine())
    log = Log(sm)
    r = log.apply(cmd(77, 1, KvPut("x", b"1")))
    assert r == SessionRejected(77, 1, "unknown_session")
    assert sm.inner.get("x") is None
    cid = log.apply(Register())
    log.apply(cmd(cid, 1, KvPut("x", b"1")))
    log.apply(Expire([cid]))
    assert cid not in sm.sessions
    # A retry after expiry must not apply again (the write would be duplicated).
    log.apply(Plain(encode_command(KvDelete("x"))))
    assert log.apply(cmd(cid, 1, KvPut("x", b"1"))) == SessionRejected(cid, 1, "unknown_session")
    assert sm.inner.get("x") is None
    # A new registration is a new id: a delayed duplicate Register never revives the old one.
    assert log.apply(Register()) != cid


def test_session_result_window_is_bounded():
    sm = SessionStateMachine(KvStateMachine(), max_results_per_session=8)
    log = Log(sm)
    cid = log.apply(Register())
    for seq in range(1, 21):  # never acknowledges
        log.apply(cmd(cid, seq, KvPut("k", b"%d" % seq)))
    s = sm.sessions[cid]
    assert len(s.results) == 8 and s.floor == 0 and s.evicted == 13
    # Evicted unacknowledged: told apart from an acknowledged (stale) seq, never re-applied.
    assert log.apply(cmd(cid, 5, KvPut("k", b"5"))) == SessionRejected(cid, 5, "result_evicted")
    assert sm.inner.get("k") == b"20"


def test_snapshot_restore_keeps_sessions_and_dedup():
    sm = SessionStateMachine(KvStateMachine())
    log = Log(sm)
    a = log.apply(Register())
    b = log.apply(Register())
    log.apply(cmd(a, 1, KvPut("k", b"a1")))
    log.apply(cmd(b, 1, KvCas("k", b"a1", b"b1")))
    log.apply(cmd(b, 2, KvDelete("gone")))
    blob = sm.snapshot()
    assert b"".join(sm.snapshot_chunks()) == blob

    restored = SessionStateMachine(KvStateMachine())
    restored.restore(blob)
    assert restored.sessions.keys() == sm.sessions.keys()
    assert restored.inner.data == sm.inner.data
    log2 = Log(restored)
    log2.index = log.index
    # Retries after a failover to a replica restored from the snapshot: still exactly once.
    assert log2.apply(cmd(b, 1, KvCas("k", b"a1", b"b1"))) is True
    assert log2.apply(cmd(b, 2, KvDelete("gone"))) is False
    assert restored.inner.get("k") == b"b1"
    assert restored.duplicates == 2
    # The original replica sees the same retries in its log, then both continue identically.
    log.apply(cmd(b, 1, KvCas("k", b"a1", b"b1")))
    log.apply(cmd(b, 2, KvDelete("gone")))
    for lg in (log, log2):
        lg.apply(cmd(a, 2, KvPut("z", b"1")))
    assert sm.inner.digest() == restored.inner.digest()


def test_corrupt_session_snapshot_rejected():
    sm = SessionStateMachine(KvStateMachine())
    Log(sm).apply(Register())
    blob = bytearray(sm.snapshot())
    blob[9] ^= 0xFF
    with pytest.raises(SnapshotCorruptionError, match="session table"):
        SessionStateMachine(KvStateMachine()).restore(bytes(blob))


def test_wraps_inner_without_chunked_snapshots():
    class Counter:
        def __init__(self):
            self.n = 0

        def apply(self, index, data):
            self.n += int(data)
            return self.n

        def snapshot(self):
            return str(self.n).encode()

        def restore(self, data):
            self.n = int(bytes(data))

    sm = SessionStateMachine(Counter())
    log = Log(sm)
    cid = log.apply(Register())
    assert log.apply(Command(cid, 1, b"5")) == 5
    assert log.apply(Command(cid, 1, b"5")) == 5
    assert sm.inner.n == 5
    r = SessionStateMachine(Counter())
    r.restore(sm.snapshot())
    assert r.inner.n == 5 and cid in r.sessions


def test_replicas_applying_same_log_with_retries_agree():
    import random

    rng = random.Random(5)
    envs = [Register(), Register(), Register()]
    seqs = {1: 0, 2: 0, 3: 0}
    sent = []
    for _ in range(500):
        cid = rng.choice([1, 2, 3])
        if sent and rng.random() < 0.3:
            envs.append(rng.choice(sent))  # a retry reaches the log again
            continue
        seqs[cid] += 1
        c = rng.choice(
            [
                KvPut(f"k{rng.randrange(5)}", b"%d" % rng.randrange(100)),
                KvDelete(f"k{rng.randrange(5)}"),
                KvCas(f"k{rng.randrange(5)}", None, b"n"),
            ]
        )
        e = cmd(cid, seqs[cid], c)
        sent.append(e)
        envs.append(e)
    replicas = [SessionStateMachine(KvStateMachine()) for _ in range(3)]
    results = []
    for r in replicas:
        log = Log(r)
        results.append([log.apply(e) for e in envs])
    assert results[0] == results[1] == results[2]
    assert replicas[0].inner.digest() == replicas[1].inner.digest() == replicas[2].inner.digest()
    # Every retry got exactly the result of its first application.
    first = {}
    for e, res in zip(envs, results[0]):
        if isinstance(e, Command):
            key = (e.client_id, e.seq)
            first.setdefault(key, res)
            assert res == first[key]
    assert replicas[0].duplicates > 100


def test_session_tracker_picks_idle_sessions():
    t = SessionTracker(ttl_s=10)
    t.reset([1, 2, 3], now=100)
    t.touch(2, 105)
    assert t.idle(109) == []
    assert t.idle(111) == [1, 3]
    t.forget([1])
    assert t.idle(200, limit=1) == [3]


def test_state_machine_protocol_declares_the_whole_contract():
    """snapshot_chunks, query and result_type are part of the declared contract (they
    are used by the driver, the session layer, the server and the client)."""
    from kvmesh.replog.types import StateMachineBase

    members = ("apply", "snapshot", "restore", "snapshot_chunks", "query", "result_type")
    for missing in members:
        # A class lacking any one member does not satisfy the protocol: it is declared.
        partial = type("Partial", (), {n: (lambda self, *a: None) for n in members if n != missing})
        assert not isinstance(partial(), StateMachine), missing
    kv = KvStateMachine()
    assert isinstance(kv, StateMachine)
    sm = SessionStateMachine(kv)
    assert isinstance(sm, StateMachine) and sm.result_type == kv.result_type
    assert sm.query(encode_command(KvGet("nope"))) is None

    class Minimal(StateMachineBase):
        def __init__(self):
            self.n = 0

        def apply(self, index, data):
            self.n += 1

        def snapshot(self):
            return b"%d" % self.n

        def restore(self, data):
            self.n = int(data)

    m = Minimal()
    assert isinstance(m, StateMachine)
    assert b"".join(m.snapshot_chunks()) == m.snapshot()
    with pytest.raises(NotImplementedError):
        m.query(b"")
    # A machine without the optional parts is not a full StateMachine.
    assert not isinstance(object(), StateMachine)
