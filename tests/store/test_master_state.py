"""StoreStateMachine: lifecycle table, fuzzed commands, determinism across snapshots, codes."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from kvmesh.replog.session import Command as SessionCommand
from kvmesh.replog.session import Register, SessionStateMachine, encode_envelope
from kvmesh.replog.storage.snapfile import SnapshotCorruptionError
from kvmesh.store import errors
from kvmesh.store.errors import Code, error_for
from kvmesh.store.master import invariants
from kvmesh.store.master.commands import (
    Codes,
    Evict,
    ExpireNodes,
    Mount,
    Pin,
    PutCommit,
    PutEnd,
    PutRevoke,
    PutStart,
    PutStartResult,
    PutStartRun,
    Reclaim,
    Release,
    Remove,
    RemoveAll,
    Unmount,
    Unpin,
    Upsert,
    decode_result,
    encode_command,
    encode_result,
)
from kvmesh.store.master.objects import TRANSITIONS, Event, State
from kvmesh.store.master.state import MasterConfig, StoreStateMachine
from kvmesh.store.types import MAX_KEY_BYTES, ReplicateConfig, key_error

CFG = MasterConfig(slice_limit=512, align=64, remount_quarantine=3.0)


def _sm() -> StoreStateMachine:
    return StoreStateMachine(CFG)


def test_error_codes_match_mooncake() -> None:
    # mooncake-store/include/types.h ErrorCode values
    assert Code.OBJECT_NOT_FOUND == -704
    assert Code.OBJECT_ALREADY_EXISTS == -705
    assert Code.OBJECT_HAS_LEASE == -706
    assert Code.LEASE_EXPIRED == -707
    assert Code.NO_AVAILABLE_HANDLE == -200
    assert Code.INVALID_KEY == -400
    assert isinstance(error_for(-704, "k"), errors.ObjectNotFound)
    assert isinstance(error_for(-704), KeyError)
    assert isinstance(error_for(-400), ValueError)
    unknown = error_for(-12345)
    assert type(unknown) is errors.StoreError and unknown.code == -12345
    for code, cls in errors.ERROR_CLASSES.items():
        assert cls.code == code and isinstance(error_for(code), cls)
    with pytest.raises(errors.NoSpace):
        errors.raise_for(-200)
    errors.raise_for(0)


def test_key_limits() -> None:
    assert key_error("k") is None
    assert key_error("") is not None
    assert key_error("x" * (MAX_KEY_BYTES + 1)) is not None
    assert key_error("é" * (MAX_KEY_BYTES // 2)) is None
    assert key_error("é" * (MAX_KEY_BYTES // 2 + 1)) is not None
    assert key_error("a\0b") is not None
    assert key_error("\udcff") is not None
    assert key_error(3) is not None


def test_lifecycle_table_is_what_apply_follows() -> None:
    """Every transition apply performs is in TRANSITIONS, and events the table lacks are
    refused: checked by driving each (state, event) pair and comparing."""
    assert (State.PROCESSING, Event.REMOVE) not in TRANSITIONS  # never free under a writer
    assert (State.PROCESSING, Event.EVICT) not in TRANSITIONS
    assert (State.COMPLETE, Event.PUT_REVOKE) not in TRANSITIONS
    sm = _sm()
    sm.apply(1, encode_command(Mount("n", "s", "e", "h", 1 << 16, 0.0)))
    cfg = ReplicateConfig()

    def fresh(key: str, complete: bool, idx: int) -> None:
        r = sm.apply(idx, encode_command(PutStart([key], [100], cfg, 0.0)))
        assert r.codes == [0]
        if complete:
            assert sm.apply(idx + 1, encode_command(PutEnd([key], [idx]))).codes == [0]

    cases = {
        Event.PUT_END: lambda k: PutEnd([k], [sm.version_of(k)]),
        Event.PUT_REVOKE: lambda k: PutRevoke([k], [sm.version_of(k)]),
        Event.REMOVE: lambda k: Remove([k]),
        Event.EVICT: lambda k: Evict([k], now=0.0),
    }
    idx = 10
    for st in (State.PROCESSING, State.COMPLETE):
        for ev, make in cases.items():
            idx += 10
            key = f"{st.name}-{ev.name}"
            fresh(key, st == State.COMPLETE, idx)
            r = sm.apply(idx + 5, encode_command(make(key)))
            after = sm.state_of(key)
            want = TRANSITIONS.get((st, ev))
            if want is None:
                assert r.codes[0] != 0 and after == st, (st, ev, r)
            else:
                assert r.codes[0] == 0 and after == want, (st, ev, r, after)
    assert not invariants.check(sm)


def _commit(rng, keys, sizes, cfg, now, reserved):
    """A PutCommit: mostly keys laid out inside one of the reservations (so some publish),
    or anywhere (refused); a reserve and a release now and then."""
    tag, sid, base = rng.randrange(300), rng.randint(1, 4), rng.randrange(0, 8192, 64)
    if reserved and rng.random() < 0.8:
        tag = rng.choice(sorted(reserved))
        sid, base, _ = rng.choice(reserved[tag])
        base += rng.choice([0, 0, 64, 128, 32])
    offs = []
    for z in sizes:
        offs.append(base)
        base += (max(z, 1) + 63) & -64 if rng.random() < 0.9 else 64
    return PutCommit(
        keys,
        sizes,
        tag if rng.random() < 0.9 else 0,
        sid,
        offs,
        cfg,
        now,
        reserve=rng.choice([0, 0, 64, 1000, 4096, 1 << 20]),
        release=rng.random() < 0.1,
    )


def _random_command(
    rng: random.Random, now: float, held: list[int], version_of=lambda k: 0, reserved=None
):
    bad = rng.random() < 0.15  # mostly valid input, so that state builds up
    names = ["a", "b", "c", "d", "e", "f", "g"] + (["", "x" * 2000] if bad else [])
    keys = [rng.choice(names) for _ in range(rng.randint(1, 4))]
    sizes = [
        rng.choice([1, 64, 500, 513, 1500, 3000] + ([0, -3, 1 << 41] if bad else [])) for _ in keys
    ]
    if bad and rng.random() < 0.3:
        sizes = sizes[:-1]
    cfg = ReplicateConfig(
        replica_num=rng.choice([1, 1, 2, 3] + ([0, 99] if bad else [])),
        strategy=rng.choice(["local", "random", "most_free"]),
        writer_host=rng.choice([None, "h0", "h1"]),
        preferred_segment=rng.choice([None, "s0", "s9"]),
        soft_pin=rng.random() < 0.2,
        hard_pin=rng.random() < 0.1,
    )
    node = rng.choice(["n0", "n1", "n2", "n3"])
    vers = (
        [rng.randrange(60) for _ in keys] if rng.random() < 0.3 else [version_of(k) for k in keys]
    )
    return rng.choice(
        [
            lambda: Mount(
                node,
                "s" + node[1],
                "ep",
                "h" + str(int(node[1]) % 2),
                rng.choice([4096, 8192, 0 if bad else 4096]),
                now,
            ),
            lambda: Mount(node, "s" + node[1], "ep", "h" + str(int(node[1]) % 2), 8192, now),
            lambda: Unmount(node, "s" + node[1], now, rng.choice([0.0, 0.0, 2.0])),
            lambda: ExpireNodes([node], now),
            lambda: PutStart(keys, sizes, cfg, now),
            lambda: PutStart(keys, sizes, cfg, now),
            lambda: Upsert(keys, sizes, cfg, now),
            lambda: PutEnd(keys, vers),
            lambda: PutEnd(keys, [version_of(k) for k in keys]),
            lambda: PutEnd(keys),
            lambda: PutRevoke(keys, vers),
            lambda: _commit(rng, keys, sizes, cfg, now, reserved),
            lambda: _commit(rng, keys, sizes, ReplicateConfig(), now, reserved),
            lambda: Remove(keys, hold=rng.random() < 0.5),
            lambda: RemoveAll([], hold=rng.random() < 0.5),
            lambda: Reclaim(now, 5.0),
            lambda: Evict(keys, vers, now, rng.random() < 0.5),
            lambda: Pin(keys, rng.random() < 0.5, now, 3.0),
            lambda: Unpin(keys),
            lambda: Release(
                [rng.choice(held) if held and rng.random() < 0.8 else rng.randrange(300)]
            ),
        ]
    )()


@pytest.mark.parametrize("seed", range(6))
def test_fuzzed_commands_keep_invariants_and_replicas_agree(seed: int) -> None:
    """Random (often invalid) commands never raise, keep every invariant, and a replica
    restored from a snapshot mid-way ends identical to one that applied everything."""
    rng = random.Random(seed)
    a = _sm()
    b = None
    cut = rng.randrange(50, 250)
    for idx in range(1, 300):
        cmd = _random_command(rng, idx * 0.1, a.held_tags(), a.version_of, a.reserved)
        data = encode_command(cmd)
        if rng.random() < 0.03:
            data = rng.randbytes(rng.randrange(20))
        ra = a.apply(idx, data)
        errs = invariants.check(a)
        assert not errs, (idx, errs)
        decode_result(encode_result(ra))  # results are wire-encodable
        if idx == cut:
            b = StoreStateMachine()
            b.restore(a.snapshot())
        elif b is not None:
            rb = b.apply(idx, data)
            assert encode_result(ra) == encode_result(rb), idx
    assert b is not None and a.digest() == b.digest()
    assert a.usage().objects == a.object_count()


def test_garbage_entry_is_a_per_entry_error() -> None:
    sm = _sm()
    assert sm.apply(1, b"\xff\x00garbage") == Codes([int(Code.INVALID_PARAMS)])
    assert sm.apply(2, encode_command(Mount("n", "s", "e", "h", 4096, 0.0))).codes == [0]


def test_batches_report_per_key() -> None:
    sm = _sm()
    sm.apply(1, encode_command(Mount("n", "s", "e", "h", 1024, 0.0)))
    r = sm.apply(
        2,
        encode_command(
            PutStart(["a", "", "b", "a", "big"], [10, 10, 10, 10, 4096], ReplicateConfig(), 0.0)
        ),
    )
    assert r.codes == [0, Code.INVALID_KEY, 0, Code.REPLICA_IS_NOT_READY, Code.NO_AVAILABLE_HANDLE]
    assert r.replicas[1] is None and r.versions == [2, 0, 2, 0, 0]
    mismatched = sm.apply(3, encode_command(PutStart(["x", "y"], [10], ReplicateConfig(), 0.0)))
    assert mismatched.codes == [Code.INVALID_PARAMS] * 2
    assert sm.apply(4, encode_command(PutEnd(["a", "b", "zz"], [2, 2, 0]))).codes == [
        0,
        0,
        Code.OBJECT_NOT_FOUND,
    ]
    assert sm.exists(["a", "b", "zz"]) == [True, True, False]
    assert sm.get_size(["a", "zz"]) == [10, Code.OBJECT_NOT_FOUND]


def test_batch_work_is_bounded() -> None:
    """A batch asking for more slices than MAX_SLICES_PER_BATCH is refused whole, before any
    allocation (a hostile entry cannot stall every replica)."""
    sm = _sm()  # slice limit 512
    sm.apply(1, encode_command(Mount("n", "s", "e", "h", 1 << 30, 0.0)))
    huge = PutStart(
        [f"k{i}" for i in range(64)], [1 << 30] * 64, ReplicateConfig(replica_num=2), 0.0
    )
    r = sm.apply(2, encode_command(huge))
    assert r.codes == [Code.INVALID_PARAMS] * 64 and sm.usage().used == 0
    ok = sm.apply(3, encode_command(PutStart(["big"], [1 << 20], ReplicateConfig(), 0.0)))
    assert ok.codes == [0] and len(ok.replicas[0][0].slices) == 2048


def test_lookup_puts_copies_on_the_readers_host_first() -> None:
    sm = _sm()
    sm.apply(1, encode_command(Mount("n1", "s1", "e1", "h1", 4096, 0.0)))
    sm.apply(2, encode_command(Mount("n2", "s2", "e2", "h2", 4096, 0.0)))
    sm.apply(
        3,
        encode_command(
            PutStart(["k"], [700], ReplicateConfig(replica_num=2, writer_host="h1"), 0.0)
        ),
    )
    sm.apply(4, encode_command(PutEnd(["k"], [3])))
    (plain,) = sm.lookup(["k"])
    assert [c.slices[0].segment for c in plain.replicas] == ["s1", "s2"]
    (near,) = sm.lookup(["k"], host="h2")
    assert [c.slices[0].segment for c in near.replicas] == ["s2", "s1"]
    assert [d.length for d in near.replicas[0].slices] == [512, 188]  # slice limit 512


def test_snapshot_corruption_is_detected() -> None:
    sm = _sm()
    sm.apply(1, encode_command(Mount("n", "s", "e", "h", 4096, 0.0)))
    sm.apply(2, encode_command(PutStart(["a"], [10], ReplicateConfig(), 0.0)))
    snap = bytearray(sm.snapshot())
    snap[-3] ^= 0x40
    with pytest.raises(SnapshotCorruptionError):
        StoreStateMachine().restore(bytes(snap))
    with pytest.raises(SnapshotCorruptionError):
        StoreStateMachine().restore(b"")


def test_inconsistent_snapshot_is_refused() -> None:
    """Well-framed (CRCs fine) but wrong images are refused: an object count that disagrees
    with the header, an undecodable object chunk."""
    from kvmesh.replog.storage.snapfile import iter_chunks, pack_chunk
    from kvmesh.store.master.objects import Obj

    sm = _sm()
    sm.apply(1, encode_command(Mount("n", "s", "e", "h", 4096, 0.0)))
    header = next(iter_chunks(sm.snapshot()))
    bad = pack_chunk(msgspec.msgpack.encode((["k"], [Obj(10, 2, 1, 0.0, b"\x09" + bytes(11))])))
    img = pack_chunk(header) + bad
    with pytest.raises(SnapshotCorruptionError):
        StoreStateMachine().restore(img)  # object count mismatch (header says 0)
    with pytest.raises(SnapshotCorruptionError):
        StoreStateMachine().restore(pack_chunk(header) + pack_chunk(b"\xc1"))


def test_snapshot_is_consistent_while_apply_continues() -> None:
    """snapshot_chunks copies the table when called; applies after that do not leak in."""
    sm = _sm()
    sm.apply(1, encode_command(Mount("n", "s", "e", "h", 1 << 20, 0.0)))
    sm.apply(
        2,
        encode_command(
            PutStart([f"k{i}" for i in range(100)], [100] * 100, ReplicateConfig(), 0.0)
        ),
    )
    want = sm.digest()
    chunks = sm.snapshot_chunks()
    sm.apply(3, encode_command(PutEnd([f"k{i}" for i in range(100)], [2] * 100)))
    sm.apply(4, encode_command(Pin(["k1"], True, 0.0)))
    sm.apply(5, encode_command(Remove(["k2"])))
    clone = StoreStateMachine()
    clone.restore(b"".join(chunks))
    assert clone.digest() == want != sm.digest()


def test_put_end_publishes_without_rewriting_the_record() -> None:
    """A PutEnd of a PROCESSING key only drops it from the PROCESSING index (the state of a
    key of the table is whether it is there): the table's columns stay as PutStart wrote
    them, and every query sees the key COMPLETE; a repeated PutEnd of the
    version is a no-op, another version InvalidWrite, before and after."""
    sm = _sm()
    sm.apply(1, encode_command(Mount("n", "s", "e", "h", 1 << 20, 0.0)))
    keys = [f"k{i}" for i in range(8)]
    sm.apply(2, encode_command(PutStart(keys, [100] * 8, ReplicateConfig(), 0.0)))
    from kvmesh.store.master.table import COLUMNS

    before = {name: getattr(sm.objects, name).copy() for name, _ in COLUMNS}
    assert sm.exists(keys) == [False] * 8 and sm.state_of("k0") == State.PROCESSING
    assert sm.apply(3, encode_command(PutEnd(keys[:4] + ["k5"], [2, 2, 2, 2, 9]))).codes == [
        0, 0, 0, 0, int(Code.INVALID_WRITE)
    ]  # fmt: skip
    assert all((getattr(sm.objects, name) == col).all() for name, col in before.items())
    assert sm.exists(keys) == [True] * 4 + [False] * 4
    assert sm.get_size(keys[3:5]) == [100, int(Code.OBJECT_NOT_FOUND)]
    assert [c for c in sm.lookup_table(keys).codes] == [0] * 4 + [-704] * 4
    assert sm.processing_puts() == [(k, 2) for k in keys[4:]]
    assert sm.apply(4, encode_command(PutEnd(["k0", "k1"], [2, 3]))).codes == [
        0, int(Code.INVALID_WRITE)
    ]  # fmt: skip
    assert sm.usage().complete == 4 and sm.usage().processing == 4
    assert not invariants.check(sm)
    # the index is checked against the table: a planted stale version is caught
    sm.processing["k6"] = 99
    assert any("PROCESSING index version" in e for e in invariants.check(sm))


def test_format_1_snapshot_images_still_restore() -> None:
    """Data directories written before the PROCESSING index moved into the snapshot header
    (format 1: every record carries its current state) restore with the same states, and
    go on from there (testdata/snapshot-format1.bin: written by that code, see
    tests/store/testdata/README.md)."""
    import os

    path = os.path.join(os.path.dirname(__file__), "testdata", "snapshot-format1.bin")
    with open(path, "rb") as f:
        img = f.read()
    sm = StoreStateMachine()
    sm.restore(img)
    got = {k: (sm.state_of(k).name, sm.version_of(k)) for k in sm.key_list()}
    assert got == {
        "c0": ("PROCESSING", 7), "c1": ("COMPLETE", 3), "c2": ("COMPLETE", 3),
        "c3": ("COMPLETE", 3), "c4": ("COMPLETE", 3), "p0": ("PROCESSING", 5),
        "p1": ("COMPLETE", 5), "p2": ("PROCESSING", 5), "q0": ("PROCESSING", 9),
    }  # fmt: skip
    assert sm.processing_puts() == [("p0", 5), ("p2", 5), ("c0", 7), ("q0", 9)]
    assert not invariants.check(sm)
    assert sm.apply(10, encode_command(PutEnd(["p0", "c0"], [5, 7]))).codes == [0, 0]
    assert sm.exists(["p0", "c0", "p2"]) == [True, True, False]
    clone = StoreStateMachine()
    clone.restore(sm.snapshot())  # written as format 2
    assert clone.digest() == sm.digest() and clone.processing_puts() == sm.processing_puts()
    assert not invariants.check(clone)


def test_version_1_file_of_a_format_3_image_still_restores(tmp_path) -> None:
    """A snapshot file written before files streamed their image (version 1: the data length
    in the header) holding a column-table image (format 3) restores with the same states and
    digest, and writes back as version 2 with the same image (testdata/README.md). The
    commands: Mount; PutStart c0..c4, p0, p1; PutEnd c0..c4; Remove c1."""
    import os

    from kvmesh.replog.storage import snapfile

    path = os.path.join(os.path.dirname(__file__), "testdata", "snapfile-v1-format3.snap")
    snap = snapfile.read_snapshot(path)
    assert snap.meta.index == 4
    sm = StoreStateMachine()
    sm.restore(snap.data)
    got = {k: (sm.state_of(k).name, sm.version_of(k)) for k in sm.key_list()}
    assert got == {
        "c0": ("COMPLETE", 2), "c2": ("COMPLETE", 2), "c3": ("COMPLETE", 2),
        "c4": ("COMPLETE", 2), "p0": ("PROCESSING", 2), "p1": ("PROCESSING", 2),
    }  # fmt: skip
    assert not invariants.check(sm)
    # The code that wrote the file digested this state as 2400407657; images since the disk
    # tier carry two more columns, so today's digest differs: what restored must survive
    # today's encoding unchanged instead.
    sm2 = StoreStateMachine()
    sm2.restore(sm.snapshot())
    assert sm2.digest() == sm.digest() and {k: sm2.version_of(k) for k in sm2.key_list()} == {
        k: v for k, (_, v) in got.items()
    }
    again = snapfile.write_snapshot(str(tmp_path), snap, chunk_bytes=100)
    back = snapfile.read_snapshot(again)
    assert back == snap and bytes(back.data) == bytes(snap.data)


def test_snapshot_header_processing_must_match_the_format() -> None:
    """A format-2 image names its PROCESSING keys; a PROCESSING key missing from the table,
    or a format-2 header without the list, is refused as corrupt."""
    from kvmesh.replog.storage.snapfile import iter_chunks, pack_chunk
    from kvmesh.store.master import snapshot as st

    sm = _sm()
    sm.apply(1, encode_command(Mount("n", "s", "e", "h", 1 << 20, 0.0)))
    sm.apply(2, encode_command(PutStart(["a", "b"], [100, 100], ReplicateConfig(), 0.0)))
    chunks = list(iter_chunks(sm.snapshot()))
    hdr = msgspec.msgpack.decode(chunks[0], type=st._Header)
    for bad in (
        msgspec.structs.replace(hdr, processing=None),
        msgspec.structs.replace(hdr, processing=["a", "zz"]),
        msgspec.structs.replace(hdr, processing=["a", "a"]),
    ):
        img = b"".join(pack_chunk(c) for c in [msgspec.msgpack.encode(bad), *chunks[1:]])
        with pytest.raises(SnapshotCorruptionError):
            StoreStateMachine().restore(img)


def test_session_wrapper_caches_typed_results() -> None:
    """Exactly-once retries through kvmesh.replog sessions give back the same result."""
    sm = SessionStateMachine(StoreStateMachine(CFG))
    cid = sm.apply(1, encode_envelope(Register()))
    sm.apply(
        2,
        encode_envelope(
            SessionCommand(cid, 1, encode_command(Mount("n", "s", "e", "h", 4096, 0.0)))
        ),
    )
    body = encode_command(PutStart(["k"], [100], ReplicateConfig(), 0.0))
    first = sm.apply(3, encode_envelope(SessionCommand(cid, 2, body)))
    again = sm.apply(4, encode_envelope(SessionCommand(cid, 2, body)))
    assert isinstance(again, PutStartRun) and again == first  # the batch path's answer
    assert again.expand() == PutStartResult([0], first.replicas, [3])
    # the per-key path's answer (a preferred segment) comes back typed too
    cfg = ReplicateConfig(preferred_segment="s")
    body = encode_command(PutStart(["k2"], [100], cfg, 0.0))
    first = sm.apply(5, encode_envelope(SessionCommand(cid, 3, body)))
    again = sm.apply(6, encode_envelope(SessionCommand(cid, 3, body)))
    assert isinstance(again, PutStartResult) and again == first and first.versions == [5]
    assert sm.inner.object_count() == 2


def test_mount_validates_its_fields() -> None:
    sm = _sm()
    for bad in (
        Mount("", "s", "e", "h", 4096, 0.0),
        Mount("n", "", "e", "h", 4096, 0.0),
        Mount("n", "s" * 2000, "e", "h", 4096, 0.0),
        Mount("n", "s", "e" * 2000, "h", 4096, 0.0),
        Mount("n", "s", "e", "h", 63, 0.0),
        Mount("n", "s", "e", "h", 1 << 41, 0.0),
    ):
        assert sm.apply(1, encode_command(bad)).codes == [Code.INVALID_PARAMS], bad
    assert sm.segments() == []


def test_snapshot_inside_the_session_wrapper() -> None:
    """The production composition: sessions around the store; a replica restored from the
    wrapper's snapshot continues identically (same results, same state)."""
    a = SessionStateMachine(StoreStateMachine(CFG))
    cid = a.apply(1, encode_envelope(Register()))
    bodies = [
        Mount("n", "s", "e", "h", 1 << 16, 0.0),
        PutStart(["x", "y"], [700, 64], ReplicateConfig(), 0.0),
        PutEnd(["x", "y"], [3, 3]),
        Remove(["y"], hold=True),
        PutStart(["z"], [100], ReplicateConfig(), 1.0),
        Release([5]),
        PutStart(["w"], [64], ReplicateConfig(), 2.0),
    ]
    envs = [
        encode_envelope(SessionCommand(cid, seq, encode_command(b)))
        for seq, b in enumerate(bodies, 1)
    ]
    for idx, env in enumerate(envs[:4], 2):
        a.apply(idx, env)
    b = SessionStateMachine(StoreStateMachine())
    b.restore(a.snapshot())
    for idx, env in enumerate(envs[4:], 6):
        assert encode_result(a.apply(idx, env)) == encode_result(b.apply(idx, env))
    assert a.inner.digest() == b.inner.digest() and a.snapshot() == b.snapshot()
    assert b.inner.placement("w") == a.inner.placement("w")


def test_remount_waits_for_the_quarantine() -> None:
    sm = _sm()
    assert sm.apply(1, encode_command(Mount("n", "s", "e", "h", 4096, 0.0))).codes == [0]
    assert sm.apply(2, encode_command(ExpireNodes(["n"], 10.0))).codes == [0]
    assert sm.apply(3, encode_command(Mount("n", "s", "e", "h", 4096, 12.0))).codes == [
        Code.SEGMENT_ALREADY_EXISTS
    ]
    assert sm.apply(4, encode_command(Mount("n", "s", "e", "h", 4096, 13.0))).codes == [0]
    seg = sm.segments()[0]
    assert seg.generation == 4 and seg.state == "mounted"


def test_results_round_trip_on_the_wire() -> None:
    r = PutStartResult([0, -704], [[], None], [3, 0])
    assert decode_result(encode_result(r)) == r
    with pytest.raises(msgspec.DecodeError):
        decode_result(b"\xc1")


def test_table_rows_stay_bounded_under_churn() -> None:
    """Removed objects' rows are reused (the table does not grow under churn), and dropping
    a segment finds exactly its live keys (a stale one would drop a key re-placed
    elsewhere, a missing one would leave a copy pointing into a dropped segment)."""
    sm = StoreStateMachine(MasterConfig(remount_quarantine=3.0))
    idx = 0

    def ap(cmd: Any) -> Any:
        nonlocal idx
        idx += 1
        return sm.apply(idx, encode_command(cmd))

    assert ap(Mount("n1", "s1", "e1", "h1", 1 << 30, 0.0)).codes == [0]
    assert ap(Mount("n2", "s2", "e2", "h2", 1 << 30, 0.0)).codes == [0]
    on = {
        "s1": ReplicateConfig(preferred_segment="s1"),
        "s2": ReplicateConfig(preferred_segment="s2"),
    }
    keys = [f"k{i}" for i in range(300)]
    for rnd in range(12):  # the same keys put and removed again and again, in both segments
        for seg in ("s1", "s2"):
            r = ap(PutStart(keys, [100] * len(keys), on[seg], 0.0))
            assert r.codes == [0] * len(keys)
            assert ap(PutEnd(keys, r.versions)).codes == [0] * len(keys)
            if rnd < 11 or seg == "s1":
                assert ap(Remove(keys)).codes == [0] * len(keys)
        batch = ap(PutStart([f"b{rnd}-{i}" for i in range(50)], [100] * 50, ReplicateConfig(), 0.0))
        assert batch.codes == [0] * 50  # the batch path too
        assert not invariants.check(sm)
    t = sm.objects
    assert t.n <= len(t) + len(keys), (t.n, len(t))  # at most one batch's rows free
    # keys k* now live in s2 only; s1 listed them 12 times
    res = ap(Unmount("n1", "s1", 0.0))
    assert res.codes == [0]
    assert not set(res.lost) & set(keys), "keys placed in s2 were dropped with s1"
    assert all(sm.exists(keys))
    assert not invariants.check(sm)
