"""The one-round-trip put (``PutCommit`` into a writer's reservation, docs/store-master.md
"Reservations"): apply publishes only extents that are unused bytes of the named
reservation, in a mounted segment; a refused key keeps its bytes reserved; the
reservation survives a snapshot and vanishes with its segment; and against a live master
a put is one round trip, another session cannot use a reservation, and an abandoned one is
freed."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvmesh.store import StoreClient
from kvmesh.store import errors as E
from kvmesh.store import protocol as P
from kvmesh.store.cluster import StoreCluster
from kvmesh.store.envelope import Echoed, EchoMachine, encode_envelope
from kvmesh.store.master import commands as C
from kvmesh.store.master import invariants
from kvmesh.store.master.objects import SLICE
from kvmesh.store.master.state import StoreStateMachine
from kvmesh.store.types import ReplicateConfig

from .e2e_util import TOKEN, Peer

CFG = ReplicateConfig()
BAD = int(E.InvalidWrite.code)


def _sm() -> tuple[StoreStateMachine, int, int, int]:
    """A master with two segments and one reservation of 64 KiB: (sm, tag, sid, offset)."""
    sm = StoreStateMachine()
    sm.apply(1, C.encode_command(C.Mount("n1", "s1", "e1", "h1", 1 << 20, 0.0)))
    sm.apply(2, C.encode_command(C.Mount("n2", "s2", "e2", "h2", 1 << 20, 0.0)))
    r = sm.apply(3, C.encode_command(C.PutCommit([], [], 0, 0, [], CFG, 1.0, reserve=64 << 10)))
    assert r.tag == 3 and r.codes == [] and r.added[2] == 64 << 10
    sid, off, _ = r.added
    return sm, r.tag, sid, off


def _commit(sm, index, keys, sizes, tag, sid, offs, **kw):
    cmd = C.PutCommit(keys, sizes, tag, sid, offs, CFG, 2.0, **kw)
    return sm.apply(index, C.encode_command(cmd))


def test_commit_publishes_a_batch_laid_out_in_the_reservation() -> None:
    sm, tag, sid, off = _sm()
    keys = [f"k{i}" for i in range(8)]
    r = _commit(sm, 4, keys, [1000] * 8, tag, sid, [off + 1024 * i for i in range(8)], reserve=8192)
    assert r.codes == [0] * 8 and r.tag == tag
    assert all(sm.state_of(k) == 2 for k in keys)  # COMPLETE at once: no PutEnd
    assert SLICE.unpack(sm.objects["k3"].layout) == (sid, off + 3 * 1024)
    assert sm.usage().reserved_bytes == (64 << 10) - 8 * 1024 + 8192
    assert sm.usage().complete == 8
    assert not invariants.check(sm)
    # the objects are ordinary ones: removed, their bytes go back to the segment
    assert sm.apply(5, C.encode_command(C.Remove(keys))).codes == [0] * 8
    assert not invariants.check(sm)


def test_commit_refuses_extents_that_are_not_unused_bytes_of_the_reservation() -> None:
    sm, tag, sid, off = _sm()
    other = 2 if sid == 1 else 1
    cases = {
        "outside": (off + (64 << 10), sid),  # just past the reservation
        "straddles": (off + (64 << 10) - 512, sid),  # its end, half out
        "before": (off - 1024, sid) if off >= 1024 else (off + (1 << 30), sid),
        "unaligned": (off + 8, sid),
        "other segment": (off, other),
    }
    idx = 4
    for name, (o, s) in cases.items():
        idx += 1
        r = _commit(sm, idx, [name], [1000], tag, s, [o])
        assert r.codes == [BAD], name
        assert sm.state_of(name) == 0, name
    # two keys of one batch on the same bytes: the second is refused
    idx += 1
    r = _commit(sm, idx, ["a", "b"], [1000, 1000], tag, sid, [off, off + 512])
    assert r.codes == [0, BAD]
    # bytes already published: refused, whatever the key
    idx += 1
    assert _commit(sm, idx, ["c"], [64], tag, sid, [off]).codes == [BAD]
    # an unknown tag (or one that is not a reservation) takes nothing
    idx += 1
    assert _commit(sm, idx, ["d"], [64], 999, sid, [off + 4096]).codes == [BAD]
    assert not invariants.check(sm)
    assert sm.usage().reserved_bytes == (64 << 10) - 1024


def test_forced_remove_hold_is_no_reservation() -> None:
    sm, tag, sid, off = _sm()
    assert _commit(sm, 4, ["x"], [1000], tag, sid, [off]).codes == [0]
    r = sm.apply(5, C.encode_command(C.Remove(["x"], force=True, hold=True)))
    assert r.codes == [0] and 5 in sm.held
    # the held bytes (a reader may still copy them) cannot be published into
    assert _commit(sm, 6, ["y"], [512], 5, sid, [off]).codes == [BAD]
    assert not invariants.check(sm)


def test_refused_key_keeps_its_bytes_reserved_and_release_frees_the_rest() -> None:
    sm, tag, sid, off = _sm()
    assert _commit(sm, 4, ["k"], [100], tag, sid, [off]).codes == [0]
    r = _commit(sm, 5, ["k", "", "z"], [100, 100, 100], tag, sid, [off + 128, off + 256, off + 384])
    assert r.codes == [int(E.ObjectExists.code), int(E.InvalidKey.code), 0]
    assert _commit(sm, 6, ["k2"], [100], tag, sid, [off + 128]).codes == [0]  # still ours
    used = sm.usage().used
    r = _commit(sm, 7, [], [], tag, 0, [], release=True)
    assert r.tag == 0 and not sm.reserved
    assert sm.usage().used == used - ((64 << 10) - 3 * 128)  # 100 bytes take 128
    assert not invariants.check(sm)
    # release and reserve in one entry: a new reservation under this entry's index
    r = _commit(sm, 8, [], [], 0, 0, [], reserve=4096)
    r = _commit(sm, 9, [], [], r.tag, 0, [], reserve=4096, release=True)
    assert r.tag == 9 and list(sm.reserved) == [9]
    assert not invariants.check(sm)


def test_reservation_survives_a_snapshot_and_goes_with_its_segment() -> None:
    sm, tag, sid, off = _sm()
    assert _commit(sm, 4, ["k"], [100], tag, sid, [off]).codes == [0]
    clone = StoreStateMachine()
    clone.restore(sm.snapshot())
    assert clone.reserved == sm.reserved and clone.digest() == sm.digest()
    for m in (sm, clone):  # the same entry gives the same answer on both
        assert _commit(m, 5, ["j"], [100], tag, sid, [off + 128]).codes == [0]
    assert clone.digest() == sm.digest()
    # the lapsed reservation is released like held bytes (the leader's Release)
    assert tag in sm.held_tags()
    node = "n1" if sid == 1 else "n2"
    sm.apply(6, C.encode_command(C.ExpireNodes([node], 3.0)))
    assert not sm.reserved and sm.usage().reserved_bytes == 0
    assert not invariants.check(sm)
    assert _commit(sm, 7, ["q"], [100], tag, sid, [off + 256]).codes == [BAD]


class _Counting(StoreStateMachine):
    """Counts the entries it had to decode (``apply``; the expected one skips it)."""

    decoded = 0

    def apply(self, index, data):
        self.decoded += 1
        return super().apply(index, data)


def _echoed(cmd) -> tuple[bytes, bytes]:
    body = C.encode_command(cmd)
    return body, encode_envelope(Echoed(body, [0] * len(cmd.keys)))


def test_the_leaders_own_commit_applies_without_a_decode_and_as_a_follower_applies_it() -> None:
    """The proposing leader's apply takes the command it built (EchoMachine.expect) only
    for the entry whose body is that command's bytes; the result and the state are the
    follower's, which decodes the same entry."""
    leader_sm, tag, sid, off = _sm()
    follower_sm = _Counting()
    follower_sm.restore(leader_sm.snapshot())
    leader_sm.__class__ = _Counting  # counting from here on
    leader, follower = EchoMachine(leader_sm), EchoMachine(follower_sm)
    keys = [f"k{i}" for i in range(8)]
    mine = C.PutCommit(keys, [1000] * 8, tag, sid, [off + 1024 * i for i in range(8)], CFG, 2.0)
    other = C.PutCommit(["x"], [1000], tag, sid, [off + 8192], CFG, 2.0, reserve=4096)
    body, entry = _echoed(mine)
    leader.expect(body, mine)
    # another entry applied first (another proposal's, or a retry): decoded, not `mine`
    _, entry2 = _echoed(other)
    for m in (leader, follower):
        assert m.apply(4, entry2).result.codes == [0]
    assert leader_sm.decoded == 1 and leader_sm.state_of("x") == 2 and leader_sm.state_of("k0") == 0
    r_leader, r_follower = leader.apply(5, entry), follower.apply(5, entry)
    assert leader_sm.decoded == 1  # its own command: no decode
    assert follower_sm.decoded == 2
    assert r_leader == r_follower and r_leader.result.codes == [0] * 8
    assert leader_sm.digest() == follower_sm.digest()
    assert not invariants.check(leader_sm)
    # any other entry decodes
    assert leader.apply(6, _echoed(C.Remove(keys))[1]).result.codes == [0] * 8
    assert leader_sm.decoded == 2


# ---------------------------------------------------------------------------- live master

LEASE_S = 1.0


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("store-commit")
    cl = StoreCluster(
        str(d), 1, token=TOKEN, durability="memory", extra_args=["--lease-ttl-s", str(LEASE_S)]
    )
    cl.start_all()
    peer = Peer(cl.address, 32 << 20)
    client = StoreClient(cl.address, token=TOKEN, timeout=10)
    try:
        yield cl, peer, client
    finally:
        client.close()
        peer.close()
        cl.close()


def _count_rpcs(c: StoreClient) -> list[str]:
    seen: list[str] = []
    mutate = c.rpc.mutate

    def counted(make, **kw):
        resp = mutate(make, **kw)
        seen.append(type(resp).__name__)
        return resp

    c.rpc.mutate = counted  # type: ignore[method-assign]
    return seen


def test_put_is_one_round_trip_and_readable_when_acknowledged(env) -> None:
    cl, peer, c = env
    src = np.frombuffer(np.random.default_rng(7).bytes(64 * 4096), np.uint8).copy()
    c.register_buffer(src)
    keys = [f"one-{i}" for i in range(64)]
    c.put_from(keys[:32], src, [i * 4096 for i in range(32)], [4096] * 32)  # reserves
    seen = _count_rpcs(c)
    try:
        res = c.put_from(keys[32:], src, [i * 4096 for i in range(32, 64)], [4000] * 32)
    finally:
        del c.rpc.mutate
    assert res.ok and seen == ["PutCommitResp"], seen
    got = c.get(keys[33])
    assert got == src[33 * 4096 : 33 * 4096 + 4000].tobytes()
    r = peer.call(op="get", keys=[keys[40]])  # another process reads it too
    assert r["codes"] == [0]
    # an existing key is refused per key; the others of the batch are published
    res = c.put_from([keys[0], "one-new"], src, [0, 4096], [4096, 4096])
    assert res.codes == [int(E.ObjectExists.code), 0]
    assert c.get("one-new") == src[4096:8192].tobytes()


def test_another_session_cannot_commit_into_a_reservation(env) -> None:
    cl, peer, c = env
    c.put("mine-0", b"m" * 5000)
    (r,) = c._reserved.by_config.values()
    sid, off, _ = r.ext[0]
    other = StoreClient(cl.address, token=TOKEN, timeout=10)
    try:
        resp = other.rpc.mutate(
            lambda rid, s: P.PutCommitReq(
                rid, s, ["stolen"], [64], r.tag, sid, [off], CFG, release=True
            )
        )
        assert type(resp) is P.PutCommitResp and resp.codes == [BAD] and resp.tag == 0
        assert other.exists("stolen") is False
    finally:
        other.close()
    c.put("mine-1", b"n" * 5000)  # the owner's reservation is untouched
    assert c.get("mine-1") == b"n" * 5000


def test_abandoned_reservation_is_freed(env) -> None:
    cl, peer, c = env
    w = StoreClient(cl.address, token=TOKEN, timeout=10)
    w.put("gone-0", b"g" * 100_000)
    assert w.status()["usage"]["reserved_bytes"] >= 100_000
    # a writer that dies keeps no reservation it could give back: close() without it
    w._reserved.by_config.clear()
    w.close()  # no commit again: the master frees it after its hold (the lease TTL)
    deadline = time.monotonic() + LEASE_S + 5
    while c.status()["usage"]["reserved_bytes"] and time.monotonic() < deadline:
        time.sleep(0.1)
    # the module's own client may hold one too; that one is renewed only by its puts
    assert c.status()["usage"]["reserved_bytes"] == 0
    assert c.get("gone-0") == b"g" * 100_000


def test_close_gives_the_reservation_back(env) -> None:
    """Idle reserved bytes are memory no one else can use: a client that closes releases
    its reservation at once rather than leaving it to lapse after its hold."""
    cl, peer, c = env
    before = c.status()["usage"]["reserved_bytes"]  # the module client's, if it holds one
    w = StoreClient(cl.address, token=TOKEN, timeout=10)
    w.put("back-0", b"b" * 100_000)
    assert c.status()["usage"]["reserved_bytes"] >= before + 100_000
    w.close()
    assert c.status()["usage"]["reserved_bytes"] == before
    assert c.get("back-0") == b"b" * 100_000


def test_reservations_are_never_placed_on_a_disk_segment() -> None:
    """A reservation is where a writer's bytes land with no checksum recorded: on a disk
    segment they would be a disk-resident object the tier knows nothing of (its reads
    unchecked). Reservations come from memory segments only, whatever has more room."""
    sm = StoreStateMachine()
    sm.apply(1, C.encode_command(C.Mount("n1", "s1", "e1", "h1", 1 << 20, 0.0)))
    disk = C.Mount("n1", "s1.disk", "e1", "h1", 64 << 20, 0.0, medium="disk")
    sm.apply(2, C.encode_command(disk))
    r = sm.apply(3, C.encode_command(C.PutCommit([], [], 0, 0, [], CFG, 1.0, reserve=128 << 10)))
    assert r.seg is not None and r.seg[0] == "s1", r
    r = sm.apply(4, C.encode_command(C.PutCommit([], [], 0, 0, [], CFG, 1.0, reserve=2 << 20)))
    assert r.added == [] and r.seg is None, r  # memory has no such room: nothing, not disk
    assert not invariants.check(sm)


def test_reservations_together_hold_at_most_a_share_of_memory() -> None:
    """Reserved bytes are not evictable: writers that stopped (or very many writers) must
    not crowd the cache out. All reservations together stay within a quarter of memory;
    past it a reserve adds nothing (the writer puts in two round trips)."""
    sm = StoreStateMachine()
    sm.apply(1, C.encode_command(C.Mount("n1", "s1", "e1", "h1", 1 << 20, 0.0)))
    r = sm.apply(2, C.encode_command(C.PutCommit([], [], 0, 0, [], CFG, 1.0, reserve=200 << 10)))
    assert r.tag == 2 and r.added[2] == 200 << 10
    r = sm.apply(3, C.encode_command(C.PutCommit([], [], 0, 0, [], CFG, 1.0, reserve=100 << 10)))
    assert r.tag == 0 and r.added == [], r  # 300 KiB > 256 KiB: refused
    r = sm.apply(4, C.encode_command(C.PutCommit([], [], 0, 0, [], CFG, 1.0, reserve=56 << 10)))
    assert r.tag == 4 and r.added[2] == 56 << 10  # exactly the share
    assert sm.usage().reserved_bytes == 256 << 10
    assert not invariants.check(sm)


def test_batch_laid_end_to_end_is_written_whole_and_a_failed_write_fails_every_key(env) -> None:
    """A batch contiguous in the caller's buffer (aligned sizes but the last) is written to
    its extent as one engine request: every key reads back its own bytes, and when that one
    request fails no key is published over bytes that were not written (all take the
    two-round-trip put)."""
    cl, peer, c = env
    src = np.frombuffer(np.random.default_rng(11).bytes(48 * 4096), np.uint8).copy()
    c.register_buffer(src)
    sizes = [4096] * 15 + [1000]  # the last one unaligned: still one run
    offs = [i * 4096 for i in range(16)]
    c.put_from(["whole-warm"], src, [0], [64])  # a reservation is held
    moves: list[int] = []
    move = c._move_arrays

    def counted(op, owner, *rest):
        moves.append(len(owner))
        return move(op, owner, *rest)

    c._move_arrays = counted  # type: ignore[method-assign]
    try:
        keys = [f"whole-{i}" for i in range(16)]
        assert c.put_from(keys, src, offs, sizes).ok
    finally:
        del c._move_arrays
    assert moves == [1]  # one request for the batch
    for k, o, z in zip(keys, offs, sizes):
        assert c.get(k) == src[o : o + z].tobytes(), k

    # The one request fails (nothing written): no key may be published into its extent.
    seen = _count_rpcs(c)
    calls = [0]

    def failing(op, owner, *rest):
        calls[0] += 1
        if calls[0] == 1:
            return np.zeros(1, np.int64), []  # owner 0 (the whole batch) failed, unwritten
        return move(op, owner, *rest)

    c._move_arrays = failing  # type: ignore[method-assign]
    base = 16 * 4096
    keys = [f"whole-fail-{i}" for i in range(16)]
    try:
        res = c.put_from(keys, src, [base + o for o in offs], sizes)
    finally:
        del c._move_arrays
        del c.rpc.mutate
    assert res.ok, res.codes
    assert "PutStartResp" in seen, seen  # every key put anew, by the two-round-trip put
    for k, o, z in zip(keys, offs, sizes):
        assert c.get(k) == src[base + o : base + o + z].tobytes(), k


def test_equal_size_batch_is_one_request_only_when_it_lies_end_to_end_in_the_buffer(env) -> None:
    """Equal sizes (the usual batch, laid out without numpy): contiguous in the caller's
    buffer, one engine request; the same sizes from places with a gap, or out of order, one
    request per key -- either way every key reads back its own bytes."""
    cl, peer, c = env
    src = np.frombuffer(np.random.default_rng(12).bytes(80 * 4096), np.uint8).copy()
    c.register_buffer(src)
    c.put_from(["eq-warm"], src, [0], [64])  # a reservation is held
    moves: list[int] = []
    move = c._move_arrays

    def counted(op, owner, *rest):
        moves.append(len(owner))
        return move(op, owner, *rest)

    layouts = {
        "contiguous": [i * 4096 for i in range(16)],
        "gap": [i * 4096 + (4096 if i >= 8 else 0) for i in range(16)],
        "reversed": [(15 - i) * 4096 for i in range(16)],
    }
    c._move_arrays = counted  # type: ignore[method-assign]
    try:
        for n, (name, offs) in enumerate(layouts.items()):
            base = 20 * 4096 * n
            keys = [f"eq-{name}-{i}" for i in range(16)]
            assert c.put_from(keys, src, [base + o for o in offs], [4096] * 16).ok, name
            for k, o in zip(keys, offs):
                assert c.get(k) == src[base + o : base + o + 4096].tobytes(), (name, k)
    finally:
        del c._move_arrays
    assert moves == [1, 16, 16], moves


def test_a_reservation_in_use_by_another_thread_is_never_given_back(env) -> None:
    """Threads of one client share its reservation. While one is writing into the bytes it
    carved, another that needs a bigger reservation must not release the old one: the
    master would hand those bytes to the next put, and the first thread's write would land
    in that object. The writes of both threads read back exactly."""
    import threading

    cl, _peer, c = env
    w = StoreClient(cl.address, token=TOKEN, timeout=10)
    try:
        w.put("warm-0", b"w" * 1000)  # a reservation of about one small batch
        inside = threading.Event()
        go = threading.Event()
        move = w._move_arrays

        def slow(op, *a, **kw):  # the first writer is held inside its write
            if threading.current_thread().name == "first":
                inside.set()
                go.wait(10)
            return move(op, *a, **kw)

        w._move_arrays = slow  # type: ignore[method-assign]
        first = threading.Thread(target=lambda: w.put(["first-0"], [b"A" * 900]), name="first")
        first.start()
        assert inside.wait(10)
        # a batch that does not fit what is left: the client asks for a new reservation
        big = [bytes([66 + i]) * 200_000 for i in range(4)]
        res = w.put([f"big-{i}" for i in range(4)], big)
        assert not any(isinstance(x, Exception) for x in res), res
        go.set()
        first.join(10)
        assert w.get([f"big-{i}" for i in range(4)]) == big
        assert w.get("first-0") == b"A" * 900
    finally:
        w.close()


def test_forged_commits_are_refused_and_the_master_serves_on(env) -> None:
    """Out-of-range and inconsistent PutCommit fields from an authenticated client, against
    the live master: every one is refused (per key or whole), none is published, and the
    master goes on serving."""
    cl, _peer, c = env
    w = StoreClient(cl.address, token=TOKEN, timeout=10)
    try:
        w.put("forge-warm", b"w" * 1000)
        tag = next(iter(w._reserved.by_config.values())).tag
        cfg = ReplicateConfig()
        bad = [
            (["f0"], [100], tag, 1, [1 << 62]),  # offset far out of the segment
            (["f1"], [100], tag, 1, [-64]),  # negative offset
            (["f2", "f3"], [100], tag, 1, [0]),  # fewer offsets than keys
            (["f4"], [1 << 40], tag, 1, [0]),  # size beyond any segment
            (["f5"], [100], tag, 999, [0]),  # no such segment
            (["f6"], [100], tag + 12345, 1, [0]),  # not our reservation
            (["f7"], [100], tag, 1, [3]),  # misaligned
        ]
        for keys, sizes, t, sid, offs in bad:
            try:
                resp = w.rpc.mutate(
                    lambda rid, s, k=keys, z=sizes, t=t, d=sid, o=offs: P.PutCommitReq(
                        rid, s, k, z, t, d, o, cfg
                    )
                )
            except E.StoreError:
                continue  # refused whole
            assert type(resp) is not P.PutCommitResp or all(resp.codes), (keys, resp)
        names = [k for b in bad for k in b[0]]
        assert w.exists(names) == [False] * len(names)
        assert c.get("forge-warm") == b"w" * 1000
    finally:
        w.close()


@pytest.mark.parametrize("sharded", [False, True])
def test_commit_of_new_keys_and_of_a_present_key_with_either_key_index(
    sharded: bool, monkeypatch
) -> None:
    """The end-to-end fast path asks the table whether every key is new. A large table's
    index is sharded (``table.Index``, past ``SHARD_AT`` keys), which has no ``keys()``
    view: the check must work on both indexes (it raised AttributeError on the sharded
    one, failing every commit of a master with more than 65,536 objects)."""
    from kvmesh.store.master import table as tbl

    if sharded:
        monkeypatch.setattr(tbl, "SHARD_AT", 2)
    sm, tag, sid, off = _sm()
    keys = [f"k{i}" for i in range(8)]
    r = _commit(sm, 4, keys, [1024] * 8, tag, sid, [off + 1024 * i for i in range(8)])
    assert r.codes == [0] * 8
    assert (type(sm.objects.index) is tbl.Index) is sharded
    more = [f"m{i}" for i in range(4)]
    r = _commit(sm, 5, more, [1024] * 4, tag, sid, [off + 8192 + 1024 * i for i in range(4)])
    assert r.codes == [0] * 4
    # a key already present in an otherwise end-to-end batch: that key alone is refused
    again = ["n0", "k3", "n2"]
    r = _commit(sm, 6, again, [1024] * 3, tag, sid, [off + 12288 + 1024 * i for i in range(3)])
    assert r.codes[0] == 0 and r.codes[1] != 0 and r.codes[2] == 0, r.codes
    assert SLICE.unpack(sm.objects["k3"].layout) == (sid, off + 3 * 1024)
    assert not invariants.check(sm)
