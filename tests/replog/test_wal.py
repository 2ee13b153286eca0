"""WAL framing, group commit, rotation, compaction and file-level fault injection."""

import os
import struct
import threading

import pytest

from kvmesh.replog.storage import wal as walmod
from kvmesh.replog.storage.wal import HEADER_BYTES, Wal, WalCorruptionError, WalFatalError


def recs(w):
    return [p for _, p in w.replay()]


def seg_files(d):
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".wal"))


def test_append_sync_reopen_roundtrip(tmp_path):
    d = str(tmp_path / "wal")
    w = Wal.open(d)
    assert recs(w) == []
    payloads = [f"record-{i}".encode() * (i + 1) for i in range(50)]
    w.append(payloads[:20])
    w.append(payloads[20:])
    w.sync()
    assert w.fsyncs == 1  # group commit: one fdatasync for both batches
    w.sync()
    assert w.fsyncs == 1  # nothing new: no fsync
    w.close()
    w2 = Wal.open(d)
    assert recs(w2) == payloads
    assert w2.truncated_bytes == 0
    w2.append([b"more"])
    w2.close()
    assert recs(Wal.open(d)) == payloads + [b"more"]


def test_rotation_preamble_and_compaction(tmp_path):
    d = str(tmp_path / "wal")
    counter = {"n": 0}

    def preamble():
        counter["n"] += 1
        return [b"PRE%d" % counter["n"]]

    w = Wal.open(d, segment_bytes=1000, preamble=preamble)
    seqs = []
    for i in range(40):
        seqs.append(w.append([b"x" * 100 + str(i).encode()]))
    w.sync()
    assert len(w.segments) > 3
    assert seqs == sorted(seqs) and seqs[0] == 1
    w.close()
    w = Wal.open(d, segment_bytes=1000, preamble=preamble)
    got = list(w.replay())
    # Each segment starts with its preamble record.
    firsts = {}
    for seq, p in got:
        firsts.setdefault(seq, p)
    assert all(p.startswith(b"PRE") for p in firsts.values())
    data = [p for _, p in got if not p.startswith(b"PRE")]
    assert data == [b"x" * 100 + str(i).encode() for i in range(40)]
    # Compaction removes whole old segments, never the active one.
    active = w.active_seq
    assert w.remove_segments_before(active + 10) == len(firsts) - 1
    assert [s.seq for s in w.segments] == [active]
    w.append([b"after"])
    w.close()
    w = Wal.open(d, segment_bytes=1000, preamble=preamble)
    left = [p for _, p in w.replay()]
    assert left[-1] == b"after" and left[0].startswith(b"PRE")


def _write_raw(path, data):
    with open(path, "ab") as f:
        f.write(data)


def test_torn_tail_partial_record_is_truncated(tmp_path):
    d = str(tmp_path / "wal")
    w = Wal.open(d)
    w.append([b"a" * 10, b"b" * 10])
    w.sync()
    w.close()
    (path,) = seg_files(d)
    good = os.path.getsize(path)
    # A record whose payload never fully reached the disk.
    _write_raw(path, struct.pack("<II", 100, 12345) + b"c" * 40)
    w = Wal.open(d)
    assert recs(w) == [b"a" * 10, b"b" * 10]
    assert w.truncated_bytes == 48
    assert os.path.getsize(path) == good
    w.append([b"d" * 5])
    w.close()
    assert recs(Wal.open(d)) == [b"a" * 10, b"b" * 10, b"d" * 5]


@pytest.mark.parametrize(
    "tail",
    [
        b"\x00" * 4096,
        b"\x07\x00",
        struct.pack("<II", 6, 0) + b"garbag",
        struct.pack("<II", 2**31, 0),
    ],
    ids=["zeros", "partial-header", "crc-mismatch", "huge-length"],
)
def test_torn_tail_variants(tmp_path, tail):
    d = str(tmp_path / "wal")
    w = Wal.open(d)
    w.append([b"one", b"two"])
    w.close()
    (path,) = seg_files(d)
    _write_raw(path, tail)
    w = Wal.open(d)
    assert recs(w) == [b"one", b"two"]
    assert w.truncated_bytes == len(tail)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_bit_flip_in_middle_record_fails_stop(tmp_path):
    d = str(tmp_path / "wal")
    w = Wal.open(d)
    w.append([b"r%03d" % i * 10 for i in range(10)])
    w.close()
    (path,) = seg_files(d)
    _flip(path, HEADER_BYTES + 8 + 5)  # inside the first record's payload
    with pytest.raises(WalCorruptionError, match="CRC mismatch.*valid record follows"):
        Wal.open(d)
    # The file is untouched: a refused start must not "repair" durable data away.
    with pytest.raises(WalCorruptionError):
        Wal.open(d)


def test_bit_flip_in_length_field_with_records_after_fails_stop(tmp_path):
    d = str(tmp_path / "wal")
    w = Wal.open(d)
    w.append([b"r%03d" % i * 10 for i in range(10)])
    w.close()
    (path,) = seg_files(d)
    _flip(path, HEADER_BYTES + 3 * 48 + 1)  # length field of record 3
    with pytest.raises(WalCorruptionError, match="valid record follows"):
        Wal.open(d)


def test_corruption_in_older_segment_fails_stop(tmp_path):
    d = str(tmp_path / "wal")
    w = Wal.open(d, segment_bytes=200)
    for _ in range(20):
        w.append([b"y" * 60])
    w.close()
    files = seg_files(d)
    assert len(files) >= 3
    # Damage the last record of a middle segment: not a tail, because later segments exist.
    size = os.path.getsize(files[1])
    _flip(files[1], size - 3)
    with pytest.raises(WalCorruptionError, match="not the last segment"):
        Wal.open(d)


def test_segment_gap_and_bad_header_fail_stop(tmp_path):
    d = str(tmp_path / "wal")
    w = Wal.open(d, segment_bytes=200)
    for _ in range(20):
        w.append([b"z" * 60])
    w.close()
    files = seg_files(d)
    os.unlink(files[1])
    with pytest.raises(WalCorruptionError, match="gap"):
        Wal.open(d)
    d2 = str(tmp_path / "wal2")
    w = Wal.open(d2)
    w.append([b"q"])
    w.close()
    (p,) = seg_files(d2)
    _flip(p, 2)
    with pytest.raises(WalCorruptionError, match="bad header"):
        Wal.open(d2)
    d3 = str(tmp_path / "wal3")
    os.makedirs(d3)
    open(os.path.join(d3, "nothex.wal"), "wb").close()
    with pytest.raises(WalCorruptionError, match="unexpected file"):
        Wal.open(d3)


def test_crash_while_creating_segment(tmp_path):
    d = str(tmp_path / "wal")
    w = Wal.open(d, segment_bytes=100)
    w.append([b"k" * 150])
    w.close()
    # The next segment was created but its header never reached the disk.
    with open(os.path.join(d, f"{2:016x}.wal"), "wb") as f:
        f.write(b"KVM")
    w = Wal.open(d, segment_bytes=100)
    assert recs(w) == [b"k" * 150]
    w.append([b"after"])
    w.close()
    assert recs(Wal.open(d)) == [b"k" * 150, b"after"]


def test_fsync_error_is_fatal(tmp_path, monkeypatch):
    d = str(tmp_path / "wal")
    w = Wal.open(d)
    w.append([b"x"])

    def boom(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(walmod.os, "fdatasync", boom)
    with pytest.raises(WalFatalError, match="fsync failed"):
        w.sync()
    monkeypatch.undo()
    # Even though fsync "works" again, the WAL refuses to continue.
    with pytest.raises(WalFatalError, match="failed earlier"):
        w.append([b"y"])
    with pytest.raises(WalFatalError):
        w.sync()
    w.close()


def test_write_error_is_fatal(tmp_path, monkeypatch):
    d = str(tmp_path / "wal")
    w = Wal.open(d)

    def enospc(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(walmod.os, "write", enospc)
    w.append([b"x"])  # kept for the sync: the writer (the event loop) never blocks in write(2)
    with pytest.raises(WalFatalError, match="write failed.*No space"):
        w.sync()
    monkeypatch.undo()
    with pytest.raises(WalFatalError):
        w.append([b"x"])
    w.close()


def test_empty_record_rejected(tmp_path):
    w = Wal.open(str(tmp_path / "wal"))
    with pytest.raises(ValueError, match="empty"):
        w.append([b""])
    w.close()


def test_detached_compaction_keeps_a_durable_oldest_segment(tmp_path, monkeypatch):
    """Compaction off the loop (detach, then unlink in a worker) syncs nothing, so it must
    never leave a segment that is not yet durable as the oldest: recovery starts from the
    oldest segment's preamble. A fresh active segment (header and preamble unsynced) keeps
    the newest closed one until the next sync; after it, only the active one is left."""
    d = str(tmp_path)
    w = Wal.open(d, segment_bytes=300, preamble=lambda: [b"PRE"])
    for i in range(20):
        w.append([b"x" * 100 + str(i).encode()])
    w.sync()
    w.rotate()  # the new active segment (header, preamble) is not synced yet
    w.append([b"y" * 100])
    active = w.active_seq
    synced = []
    monkeypatch.setattr(os, "fdatasync", lambda fd: synced.append(fd))
    doomed = w.detach_segments_before(active + 10)
    assert not synced  # no sync: cheap enough for the event loop
    assert [s.seq for s in w.segments] == [active - 1, active]
    assert all(os.path.exists(s.path) for s in doomed)  # files go only in unlink_segments
    w.unlink_segments(doomed)
    assert not any(os.path.exists(s.path) for s in doomed)
    monkeypatch.undo()
    w.sync()
    w.unlink_segments(w.detach_segments_before(active + 10))
    assert [s.seq for s in w.segments] == [active]
    w.close()
    w = Wal.open(d, segment_bytes=300, preamble=lambda: [b"PRE"])
    got = [p for _, p in w.replay()]
    assert got[0] == b"PRE" and got[-1] == b"y" * 100
    w.close()


def test_records_reach_the_file_in_the_sync_not_in_append(tmp_path, monkeypatch):
    """The node appends on its event loop and syncs in a worker thread: write(2), which can
    block under dirty-page writeback, must run in the sync, in order, before fdatasync."""
    w = Wal.open(str(tmp_path / "wal"))
    w.sync()
    calls = []
    real_write, real_sync = walmod.os.write, walmod.os.fdatasync
    monkeypatch.setattr(
        walmod.os,
        "write",
        lambda fd, b: calls.append(("write", threading.get_ident())) or real_write(fd, b),
    )
    monkeypatch.setattr(
        walmod.os, "fdatasync", lambda fd: calls.append(("sync", None)) or real_sync(fd)
    )
    for i in range(3):
        w.append([b"record-%d" % i])
    assert calls == []  # the appending thread wrote nothing
    t = threading.Thread(target=w.sync)
    t.start()
    t.join()
    assert [c[0] for c in calls] == ["write"] * 3 + ["sync"]
    assert {c[1] for c in calls if c[0] == "write"} == {t.ident}
    monkeypatch.undo()
    w.close()
    w = Wal.open(str(tmp_path / "wal"))
    assert [p for _, p in w.replay()][-3:] == [b"record-0", b"record-1", b"record-2"]
    w.close()
