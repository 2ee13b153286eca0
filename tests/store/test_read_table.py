"""The table form of a lookup (``lookup_table`` / ``ReplicaTableResp``): the vectorised
simple-batch path answers exactly what the per-key loop answers (reply budget included), and
the client refuses a malformed table whole instead of reporting bytes it never copied."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvmesh.store import errors as E
from kvmesh.store import protocol as P
from kvmesh.store.client.table import check_table as _table
from kvmesh.store.master import queries as queries_mod
from kvmesh.store.master.commands import Mount, PutEnd, PutStart, encode_command
from kvmesh.store.master.leases import LeaseTable
from kvmesh.store.master.state import MasterConfig, StoreStateMachine
from kvmesh.store.types import ROW, ReplicateConfig, replica_lists


def _filled(n: int) -> tuple[StoreStateMachine, list[str]]:
    sm = StoreStateMachine(MasterConfig(slice_limit=4096, align=64))
    sm.apply(1, encode_command(Mount("n1", "s1", "e1", "h1", 1 << 24, 0.0)))
    sm.apply(2, encode_command(Mount("n2", "seg-two", "e2", "h2", 1 << 24, 0.0)))
    keys = [f"k{i}" for i in range(n)]
    cfg = ReplicateConfig(strategy="random")  # spreads keys over both segments
    r = sm.apply(3, encode_command(PutStart(keys, [100 + i for i in range(n)], cfg, 0.0)))
    assert r.codes == [0] * n
    sm.apply(4, encode_command(PutEnd(keys, [3] * n)))
    return sm, keys


def _both(sm, keys, monkeypatch, **kw):
    fast = sm.lookup_table(keys, **kw)
    monkeypatch.setattr(queries_mod, "_SIMPLE_MIN", 1 << 30)  # the per-key loop only
    slow = sm.lookup_table(keys, **kw)
    monkeypatch.undo()
    return fast, slow


def _same(a, b) -> None:
    assert a.codes == b.codes and a.sizes == b.sizes and a.versions == b.versions
    assert replica_lists(a) == replica_lists(b)


def test_simple_batch_path_matches_the_loop(monkeypatch):
    sm, keys = _filled(64)
    calls = []
    real = sm._lookup_simple
    monkeypatch.setattr(sm, "_lookup_simple", lambda *a: calls.append(1) or real(*a))
    fast, slow = _both(sm, keys, monkeypatch)
    assert calls and len(fast.segments) == 2  # the fast path ran, over both segments
    _same(fast, slow)
    assert fast.rows.shape == (64, ROW) and fast.rows[:, 4].tolist() == fast.sizes
    # A budget that holds only part of the batch: the loop answers it (refusing the rest
    # in key order) and the fast path must not answer differently.
    fast, slow = _both(sm, keys, monkeypatch, max_bytes=500)
    _same(fast, slow)
    assert 0 < fast.codes.count(0) < 64 and fast.codes[-1] == E.InvalidParams.code
    # The budget bounds the table form too (its rows outweigh these short names' objects).
    assert fast.rows.nbytes <= 500
    # Mixed batches (a missing key, a duplicate) take the loop and still agree.
    mixed = [*keys[:20], "absent", keys[3]]
    _same(*_both(sm, mixed, monkeypatch))


def test_single_key_path_matches_the_loop(monkeypatch):
    sm, keys = _filled(8)
    calls = []
    real = sm._lookup_one
    monkeypatch.setattr(sm, "_lookup_one", lambda k: calls.append(k) or real(k))
    big = "big"  # an object of several slices: the loop answers it
    sm.apply(5, encode_command(PutStart([big], [10_000], ReplicateConfig(), 0.0)))
    sm.apply(6, encode_command(PutEnd([big], [5])))
    for k in [*keys, "absent", big]:
        for kw in ({}, {"max_bytes": 1}):  # the first key is answered whatever the budget
            fast = sm.lookup_table([k], **kw)
            monkeypatch.setattr(sm, "_lookup_one", lambda k: None)
            slow = sm.lookup_table([k], **kw)
            monkeypatch.setattr(sm, "_lookup_one", lambda k: calls.append(k) or real(k))
            _same(fast, slow)
            assert fast.rows.tolist() == slow.rows.tolist() and fast.segments == slow.segments
    assert keys[0] in calls and real("absent") is None and real(big) is None
    assert len(sm.lookup_table([big]).rows) == 3  # 10,000 bytes in slices of 4096


def _resp(codes, sizes, rows, segs=(("s", "n", "e"),)) -> P.ReplicaTableResp:
    raw = np.asarray(rows, "<i8").reshape(-1, ROW).tobytes()
    return P.ReplicaTableResp(1, list(codes), list(sizes), list(segs), raw, 5000)


def test_client_accepts_a_well_formed_table():
    # key 0: two copies, the second in two slices; key 1 not found; key 2 one slice
    rows = [(0, 0, 0, 0, 10), (0, 1, 0, 100, 4), (0, 1, 0, 200, 6), (2, 0, 0, 300, 5)]
    codes, sizes, got = _table(_resp([0, -704, 0], [10, 0, 5], rows), 3)
    assert list(codes) == [0, -704, 0] and got.tolist() == [list(r) for r in rows]


@pytest.mark.parametrize(
    "codes,sizes,rows",
    [
        ([0], [10], [(0, 0, 0, 0, 9)]),  # slices shorter than the object
        ([0], [10], [(0, 0, 0, 0, 10), (0, 2, 0, 50, 10)]),  # copy 1 missing
        ([0, 0], [10, 10], [(1, 0, 0, 0, 10), (0, 0, 0, 20, 10)]),  # keys out of order
        ([0, 0], [10, 10], [(0, 0, 0, 0, 10)]),  # a found key without rows
        ([-704], [0], [(0, 0, 0, 0, 10)]),  # rows for a key not found
        ([0], [10], [(0, 0, 1, 0, 10)]),  # unknown segment
        ([0], [10], [(0, 0, 0, -5, 10)]),  # negative offset
        ([0], [10], [(3, 0, 0, 0, 10)]),  # key index out of range
        ([0], [0], [(0, 0, 0, 0, 0)]),  # empty slice
        ([0, 0], [10], []),  # sizes shorter than codes
        # int64 sums that wrap to the size (4 x 2**62 + 10): slices longer than any object
        ([0], [10], [(0, 0, 0, 0, 1 << 62)] * 3 + [(0, 0, 0, 0, (1 << 62) + 10)]),
        ([0, 0], [1 << 63, 10], [(0, 0, 0, 0, 10), (1, 0, 0, 0, 10)]),  # size beyond int64
        ([-704, -704], [(1 << 64) - 1, 0], []),  # ints beyond int64 in a table of misses
        ([(1 << 64) - 1], [0], []),
        ([0, 0], [10, 10], [(0, 0, 0, 0, 10), (1, (1 << 63) - 1, 0, 0, 10)]),  # copy 2**63-1
    ],
)
def test_client_refuses_a_malformed_table(codes, sizes, rows):
    with pytest.raises(E.InternalError):
        _table(_resp(codes, sizes, rows), len(codes))


def test_client_refuses_a_table_of_partial_rows():
    bad = P.ReplicaTableResp(1, [0], [10], [("s", "n", "e")], b"\0" * 12, 5000)
    with pytest.raises(E.InternalError):
        _table(bad, 1)


def test_get_replicas_answers_blocked_keys_not_found_in_both_forms():
    """A key whose removal is in flight gets no lease, answers ObjectNotFound, and its
    descriptors are not in the reply (table rows or objects); the others are served."""
    from kvmesh.net.security import SecurityConfig
    from kvmesh.store.service import MasterService, ServiceConfig

    svc = MasterService(
        ServiceConfig(listen="127.0.0.1:0", durability="memory"), SecurityConfig(token="t")
    )
    svc.sm, keys = _filled(40)  # the state machine only: no raft node, no socket
    svc.leases = LeaseTable()  # no new-leader blanket period
    svc.leases.block(["k3", "k30"])
    for table in (True, False):
        resp = svc._get_replicas(P.GetReplicasReq(1, [*keys, "absent"], "", table))
        bad = {3, 30, 40}
        assert [i for i, c in enumerate(resp.codes) if c] == sorted(bad)
        assert all(resp.sizes[i] == 0 for i in bad) and resp.sizes[0] == 100
        if table:
            codes, sizes, rows = _table(resp, 41)
            assert sorted(set(rows[:, 0].tolist())) == [i for i in range(40) if i not in bad]
        else:
            assert all(resp.replicas[i] is None for i in bad) and resp.replicas[0]
    later = time.monotonic() + 1  # within the 5 s ttl of the grants above
    assert not svc.leases.leased("k3", later) and svc.leases.leased("k4", later)


def _consistent(codes, sizes, rows) -> str | None:
    """Why an accepted table breaks what readers rely on, or None: rows only for found
    keys, in key then copy order, copies numbered 0.. per key, each copy's slices adding
    up to the object's size, segment indexes in range, offsets >= 0, lengths > 0."""
    copies: dict[int, dict[int, int]] = {}
    last = (-1, -1)
    for k, c, y, ro, ln in rows:
        if not (0 <= k < len(codes) and codes[k] == 0 and y == 0 and ro >= 0 and ln > 0):
            return f"row {(k, c, y, ro, ln)}"
        if (k, c) < last:
            return "order"
        last = (k, c)
        copies.setdefault(k, {})
        copies[k][c] = copies[k].get(c, 0) + ln
    for k, code in enumerate(codes):
        if code == 0:
            got = copies.get(k, {})
            if not got or sorted(got) != list(range(len(got))):
                return f"copies of key {k}: {sorted(got)}"
            if any(total != sizes[k] for total in got.values()):
                return f"key {k}: copy sizes {got} vs {sizes[k]}"
    return None


def test_random_tables_are_refused_or_consistent():
    """A seeded fuzz of forged tables (edge values: +-2**63, 2**62 sums that wrap, huge copy
    indexes): every table is refused with InternalError or is consistent; nothing else is
    raised (an OverflowError used to escape a read)."""
    import random

    rng = random.Random(7)
    edge = [0, 1, 2, 10, -1, 1 << 62, (1 << 62) + 1, (1 << 63) - 1, -(1 << 63), 1 << 40]
    accepted = 0
    for _ in range(20_000):
        n = rng.randint(1, 3)
        codes = [0 if rng.random() < 0.8 else -704 for _ in range(n)]
        sizes = [rng.choice([10, 20, 1 << 40]) if c == 0 else 0 for c in codes]
        rows = [
            [
                rng.randint(0, n - 1) if rng.random() < 0.8 else rng.choice(edge),
                rng.randint(0, 2) if rng.random() < 0.8 else rng.choice(edge),
                0 if rng.random() < 0.9 else rng.choice(edge),
                rng.randint(0, 100),
                rng.choice([5, 10, 15, 20, 1 << 40]) if rng.random() < 0.8 else rng.choice(edge),
            ]
            for _ in range(rng.randint(1, 5))
        ]
        if rng.random() < 0.7:
            rows.sort(key=lambda r: (r[0], r[1]))
        try:
            _table(_resp(codes, sizes, rows), n)
        except E.InternalError:
            continue
        accepted += 1
        why = _consistent(codes, sizes, rows)
        assert why is None, (why, codes, sizes, rows)
    assert accepted > 20  # the fuzz reaches the acceptance path, not only refusals


def test_exists_flags_match_exists():
    """The service's one-pass ``exists_flags`` answers 1 / 0 exactly where ``exists`` answers
    True / False: COMPLETE objects only (a PROCESSING put and a missing key are 0)."""
    sm, keys = _filled(40)
    sm.apply(5, encode_command(PutStart(["pending"], [100], ReplicateConfig(), 0.0)))
    batch = [*keys[::3], "pending", "absent", keys[1], "pending"]
    flags = sm.exists_flags(batch)
    assert flags == [1 if x else 0 for x in sm.exists(batch)]
    assert flags.count(0) == 3 and all(type(f) is int for f in flags)
    assert sm.exists_flags([]) == []
