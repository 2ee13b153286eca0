"""Snapshot files (atomic write, full verification) and chunked state-machine images."""

import os

import crc32c
import pytest

from kvmesh.replog.kvsm import (
    CHUNK_ITEMS,
    KvBatch,
    KvCas,
    KvDelete,
    KvGet,
    KvPut,
    KvStateMachine,
    decode_command,
    encode_command,
)
from kvmesh.replog.storage import snapfile
from kvmesh.replog.storage.snapfile import SnapshotCorruptionError, iter_chunks, pack_chunk
from kvmesh.replog.types import ConfState, Snapshot, SnapshotMeta, StateMachine

META = SnapshotMeta(1234, 5, ConfState((1, 2, 3), (4,)))


def test_roundtrip_multi_chunk(tmp_path):
    data = os.urandom(300_000)
    path = snapfile.write_snapshot(str(tmp_path), Snapshot(META, data), chunk_bytes=64 * 1024)
    assert os.path.basename(path) == f"snap-{1234:016x}-{5:016x}.snap"
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert snapfile.read_snapshot(path) == Snapshot(META, data)
    assert snapfile.read_snapshot_meta(path) == META
    assert [s.index for s in snapfile.list_snapshots(str(tmp_path))] == [1234]
    empty = snapfile.write_snapshot(str(tmp_path), Snapshot(SnapshotMeta(1, 1), b""))
    assert snapfile.read_snapshot(empty).data == b""


@pytest.mark.parametrize("where", ["header", "chunk", "trailer", "truncate", "extra", "magic"])
def test_any_damage_is_detected(tmp_path, where):
    data = os.urandom(200_000)
    path = snapfile.write_snapshot(str(tmp_path), Snapshot(META, data), chunk_bytes=50_000)
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    if where == "header":
        raw[14] ^= 1
    elif where == "chunk":
        raw[len(raw) // 2] ^= 0x80
    elif where == "trailer":
        raw[-2] ^= 1
    elif where == "truncate":
        del raw[-100:]
    elif where == "extra":
        raw += b"\0" * 10
    elif where == "magic":
        raw[0] ^= 1
    with open(path, "wb") as f:
        f.write(bytes(raw))
    with pytest.raises(SnapshotCorruptionError):
        snapfile.read_snapshot(path)


def test_renamed_file_is_detected(tmp_path):
    path = snapfile.write_snapshot(str(tmp_path), Snapshot(META, b"x"))
    other = os.path.join(str(tmp_path), f"snap-{9999:016x}-{5:016x}.snap")
    os.rename(path, other)
    with pytest.raises(SnapshotCorruptionError, match="name disagrees"):
        snapfile.read_snapshot(other)


def test_tmp_cleanup_and_pruning(tmp_path):
    d = str(tmp_path)
    paths = [
        snapfile.write_snapshot(d, Snapshot(SnapshotMeta(i, 1), b"%d" % i)) for i in (10, 20, 30)
    ]
    with open(os.path.join(d, f"snap-{40:016x}-{1:016x}.snap.tmp"), "wb") as f:
        f.write(b"partial")
    assert snapfile.cleanup_tmp(d) == 1
    assert snapfile.remove_snapshots_except(d, paths[1:]) == 1
    assert [s.index for s in snapfile.list_snapshots(d)] == [20, 30]


def test_chunk_framing():
    blob = pack_chunk(b"a" * 10) + pack_chunk(b"bb") + pack_chunk(b"")
    assert [bytes(c) for c in iter_chunks(blob)] == [b"a" * 10, b"bb", b""]
    bad = bytearray(blob)
    bad[10] ^= 1
    with pytest.raises(SnapshotCorruptionError, match="CRC"):
        list(iter_chunks(bytes(bad)))
    with pytest.raises(SnapshotCorruptionError, match="past the end"):
        list(iter_chunks(blob[:12]))
    with pytest.raises(SnapshotCorruptionError, match="partial"):
        list(iter_chunks(blob + b"\x01\x00"))


# ---------------------------------------------------------------- KV state machine


def test_kv_state_machine_semantics():
    sm = KvStateMachine()
    assert isinstance(sm, StateMachine)
    ap = lambda i, c: sm.apply(i, encode_command(c))  # noqa: E731
    assert ap(1, KvGet("k")) is None
    assert ap(2, KvPut("k", b"v")) is None
    assert ap(3, KvGet("k")) == b"v"
    assert ap(4, KvCas("k", b"nope", b"w")) is False
    assert ap(5, KvCas("k", b"v", b"w")) is True
    assert ap(6, KvCas("new", None, b"n")) is True
    assert ap(7, KvDelete("k")) is True
    assert ap(8, KvDelete("k")) is False
    assert ap(9, KvBatch([KvPut("a", b"1"), KvGet("a"), KvDelete("zz")])) == [None, b"1", False]
    assert sm.data["a"].index == 9 and sm.applied == 9
    assert decode_command(encode_command(KvCas("x", None, b"y"))) == KvCas("x", None, b"y")


def test_kv_chunked_snapshot_roundtrip_is_consistent_image():
    sm = KvStateMachine()
    n = CHUNK_ITEMS * 2 + 17
    for i in range(n):
        sm.apply(i + 1, encode_command(KvPut(f"k{i}", b"%d" % i)))
    chunks = sm.snapshot_chunks()  # the image is fixed here...
    sm.apply(n + 1, encode_command(KvPut("late", b"x")))  # ...so later writes are not in it
    sm.apply(n + 2, encode_command(KvDelete("k0")))
    blob = b"".join(chunks)
    assert len(list(iter_chunks(blob))) == 3
    r = KvStateMachine()
    r.restore(blob)
    assert len(r.data) == n and "late" not in r.data and r.get("k0") == b"0"
    assert list(r.data)[:3] == ["k0", "k1", "k2"]  # insertion order is preserved
    full = KvStateMachine()
    full.restore(sm.snapshot())
    assert full.digest() == sm.digest() != r.digest()


def test_write_from_parts_without_joining(tmp_path):
    parts = [os.urandom(n) for n in (10, 0, 70_000, 1, 3 << 20)]
    path = snapfile.write_snapshot(str(tmp_path), Snapshot(META), parts=parts)
    assert snapfile.read_snapshot(path) == Snapshot(META, b"".join(parts))
    # A zero-length image is valid too.
    p2 = snapfile.write_snapshot(str(tmp_path / "e"), Snapshot(SnapshotMeta(2, 1)), parts=[b""])
    assert snapfile.read_snapshot(p2).data == b""


def _write_version_1(path, meta, pieces):
    """A file as version 1 wrote it: the data length in the header, no end frame."""
    import msgspec

    total = sum(map(len, pieces))
    hdr = snapfile.SnapHeader(1, meta.index, meta.term, meta.conf_state, total, 1 << 20)
    with open(path, "wb") as f:
        f.write(b"KVMSNAP1" + pack_chunk(msgspec.msgpack.encode(hdr)))
        for p in pieces:
            f.write(pack_chunk(p))
        crc = crc32c.crc32c(b"".join(pieces))
        f.write(pack_chunk(msgspec.msgpack.encode(snapfile.SnapTrailer(len(pieces), total, crc))))


def test_version_1_files_still_read(tmp_path):
    pieces = [os.urandom(n) for n in (1000, 5, 70_000)]
    path = str(tmp_path / f"snap-{1234:016x}-{5:016x}.snap")
    _write_version_1(path, META, pieces)
    assert snapfile.read_snapshot(path) == Snapshot(META, b"".join(pieces))
    assert snapfile.read_snapshot_meta(path) == META
    # ...and a damaged one is still refused
    with open(path, "r+b") as f:
        f.seek(-200, os.SEEK_END)
        f.write(b"\xff")
    with pytest.raises(SnapshotCorruptionError):
        snapfile.read_snapshot(path)


def test_writer_streams_and_reader_holds_one_copy(tmp_path):
    """The writer takes the image piece by piece (an iterator: nothing joined, nothing
    kept), and the reader reads the pieces into one buffer: its memory peak is the image
    once, not the file plus a joined copy plus ``bytes`` of it (three, before)."""
    import tracemalloc

    piece = os.urandom(1 << 20)
    n = 24
    tracemalloc.start()
    try:
        fresh = (bytes(bytearray(piece)) for _ in range(n))  # a new buffer each, like an encoder
        path = snapfile.write_snapshot(str(tmp_path), Snapshot(META), parts=fresh)
        _, wpeak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        snap = snapfile.read_snapshot(path)
        _, rpeak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = n * len(piece)
    assert len(snap.data) == size and snap.data[: len(piece)] == piece
    assert wpeak < size / 4, (wpeak, size)
    assert rpeak < size * 1.25, (rpeak, size)

    # a writer that fails midway leaves no file behind, not even its temp file
    def boom():
        yield piece
        raise RuntimeError("encoder failed")

    with pytest.raises(RuntimeError):
        snapfile.write_snapshot(str(tmp_path / "x"), Snapshot(SnapshotMeta(9, 1)), parts=boom())
    assert os.listdir(tmp_path / "x") == []
