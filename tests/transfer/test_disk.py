"""Disk segments (kvmesh/transfer/disk.py): real files, byte-exact, local and through the owner.

The owner of a disk segment in another process is tests/transfer/disk_peer.py; its bytes come
over the TCP path (the owner reads or writes the file). Every test checks the file itself too,
so a range landing at the wrong offset cannot pass by being read back from the same wrong
place.
"""

from __future__ import annotations

import mmap
import os
import shutil
import sys
import threading
import time

import msgspec
import numpy as np
import pytest

from bench._common import Child
from kvmesh.transfer import (
    AuthError,
    InvalidArgument,
    Op,
    OutOfBounds,
    PeerDeadError,
    SegmentNotFound,
    TransferError,
    TransportKind,
)
from kvmesh.transfer import disk as D

from .util import pattern

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20

# (memory offset, segment offset, length): aligned, unaligned heads/tails, memory aligned
# unlike the file (bounced), sub-block, a range over 8 MiB (cut between job checks).
RANGES = [
    (0, 0, 4096),
    (8192, 8192, 64 << 10),
    (100_007, 100_003, 3 * 4096 + 5),
    (1 << 20, (1 << 20) + 4095, 5000),
    (2 << 20, (3 << 20) + 1, 1),
    (3 << 20, 6 << 20, (1 << 20) + 4096),  # aligned both sides: all O_DIRECT
    (5 << 20, (9 << 20) + 512, 3 << 20),  # file 512-aligned, memory 4096-aligned: bounced
    (9 << 20, 16 << 20, 9 << 20),
    ((19 << 20) + 100, (26 << 20) + 100, (2 << 20) + 50),  # head and tail around O_DIRECT
]


def _arrays(ranges):
    lo, ro, ln = (np.array(c, np.int64) for c in zip(*ranges))
    return lo, ro, ln


def _aligned(data: np.ndarray | int) -> np.ndarray:
    """Page-aligned memory (numpy's is not), so aligned ranges take the O_DIRECT path."""
    n = data if isinstance(data, int) else len(data)
    out = np.frombuffer(mmap.mmap(-1, n), np.uint8)
    if not isinstance(data, int):
        out[:] = data
    return out


def _file_bytes(path: str, off: int, n: int) -> np.ndarray:
    with open(path, "rb") as f:
        f.seek(off)
        return np.frombuffer(f.read(n), np.uint8)


def _disk_peer(path, size, *args: str) -> Child:
    return Child(
        [sys.executable, "-m", "tests.transfer.disk_peer", str(path), str(size), *args],
        cwd=ROOT,
        timeout=60,
    )


@pytest.mark.parametrize("direct", [None, False], ids=["auto", "buffered"])
def test_local_roundtrip_byte_exact(make_engine, tmp_path, direct):
    eng = make_engine()
    path = tmp_path / "seg"
    size = 32 * MiB
    seg = eng.register_disk(path, size, name="d", direct=direct)
    assert os.path.getsize(path) == size  # reserved at registration
    if direct is False:
        assert not seg.direct
    src = _aligned(pattern(1, 0, 24 * MiB))
    dst = _aligned(24 * MiB)
    ls, ld = eng.register(src), eng.register(dst)
    rs = eng.open_segment(eng.address, "d")
    lo, ro, ln = _arrays(RANGES)
    res = eng.transfer(Op.WRITE, ls, lo, rs, ro, ln)
    assert res.transports == [TransportKind.DISK]
    for m, o, n in RANGES:
        assert (_file_bytes(str(path), o, n) == src[m : m + n]).all(), (m, o, n)
    # Read back into other offsets (memory unaligned by 1 for some: bounced) and batches.
    shift = np.array([0, 1, 0, 3, 0, 0, 4096, 1, 0], np.int64)
    eng.transfer(Op.READ, ld, lo + shift, rs, ro, ln)
    for (m, o, n), s in zip(RANGES, shift.tolist()):
        assert (dst[m + s : m + s + n] == src[m : m + n]).all(), (m, o, n)
    with eng.batch() as b:
        b.add_many(Op.READ, ld, lo, rs, ro, ln)
        b.submit(timeout=30)
        b.wait()
    for m, _, n in RANGES:
        assert (dst[m : m + n] == src[m : m + n]).all()


def test_directory_segment_spans_files(make_engine, tmp_path):
    eng = make_engine()
    fb = 256 << 10
    seg = eng.register_disk(tmp_path, 2 * MiB + 4096, name="d", file_bytes=fb)
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 9 and os.path.getsize(tmp_path / files[-1]) == 4096
    src = pattern(2, 0, 2 * MiB)
    ls = eng.register(src)
    rs = eng.open_segment(eng.address, "d")
    off, n = fb - 100, fb + 300  # over two file boundaries
    eng.write(ls, 5, rs, off, n)
    assert (_file_bytes(str(tmp_path / files[0]), fb - 100, 100) == src[5:105]).all()
    assert (_file_bytes(str(tmp_path / files[1]), 0, fb) == src[105 : 105 + fb]).all()
    assert (_file_bytes(str(tmp_path / files[2]), 0, 200) == src[105 + fb : 5 + n]).all()
    dst = eng.register(np.zeros(n, np.uint8))
    eng.read(dst, 0, rs, off, n)
    assert (dst.array() == src[5 : 5 + n]).all()
    crc = eng.checksum_segment(rs, [off], [n])
    assert int(crc[0]) == D.checksum(src[5 : 5 + n])
    assert seg.size == 2 * MiB + 4096


def test_remote_roundtrip_through_owner(make_engine, tmp_path):
    path = tmp_path / "seg"
    owner = _disk_peer(path, 32 * MiB)
    try:
        eng = make_engine()
        rs = eng.open_segment(owner.info["address"], "disk")
        assert rs.kind.value == "disk" and rs.size == 32 * MiB
        src = _aligned(pattern(3, 0, 24 * MiB))
        ls = eng.register(src)
        lo, ro, ln = _arrays(RANGES)
        res = eng.transfer(Op.WRITE, ls, lo, rs, ro, ln)
        assert res.transports == [TransportKind.TCP]
        for m, o, n in RANGES:
            assert (_file_bytes(str(path), o, n) == src[m : m + n]).all(), (m, o, n)
        dst = np.zeros(24 * MiB, np.uint8)
        ld = eng.register(dst)
        eng.transfer(Op.READ, ld, lo, rs, ro, ln)
        for m, _, n in RANGES:
            assert (dst[m : m + n] == src[m : m + n]).all()
        crcs = eng.checksum_segment(rs, ro, ln)
        assert crcs.tolist() == [D.checksum(src[m : m + n]) for m, _, n in RANGES]
        eng.sync_segment(rs)
    finally:
        owner.close()


def test_out_of_range_refused_here_and_by_the_owner(make_engine, tmp_path):
    owner = _disk_peer(tmp_path / "seg", 1 * MiB)
    try:
        eng = make_engine()
        ls = eng.register(np.zeros(2 * MiB, np.uint8))
        local = eng.register_disk(tmp_path / "mine", 1 * MiB, name="mine")
        for rs in (
            eng.open_segment(owner.info["address"], "disk"),
            eng.open_segment(eng.address, "mine"),
        ):
            for off, n in ((1 * MiB - 10, 11), (1 * MiB, 1), (-1, 10)):
                with pytest.raises(OutOfBounds):
                    eng.write(ls, 0, rs, off, n)
                with pytest.raises(OutOfBounds):
                    eng.read(ls, 0, rs, off, n)
            with pytest.raises(OutOfBounds):
                eng.checksum_segment(rs, [1 * MiB - 1], [2])
        # A hostile (or confused) peer that claims a bigger segment: the owner refuses it
        # before a byte lands, and the file did not grow.
        rs = eng.open_segment(owner.info["address"], "disk")
        big = msgspec.structs.replace(rs.desc, size=64 * MiB)
        forged = type(rs)(big, rs.peer)
        with pytest.raises(OutOfBounds):
            eng.write(ls, 0, forged, 2 * MiB, 4096)
        with pytest.raises(OutOfBounds):
            eng.read(ls, 0, forged, 1 * MiB - 4096, 8192)
        assert os.path.getsize(tmp_path / "seg") == 1 * MiB
        # Nor can it name another segment id: refused as gone.
        stale = type(rs)(msgspec.structs.replace(rs.desc, seg_id=rs.desc.seg_id ^ 1), rs.peer)
        with pytest.raises(SegmentNotFound):
            eng.write(ls, 0, stale, 0, 4096)
        with pytest.raises(SegmentNotFound):
            eng.sync_segment(stale)
        assert local.size == 1 * MiB
    finally:
        owner.close()


def test_peer_without_the_credential_is_refused(make_engine, tmp_path):
    owner = _disk_peer(tmp_path / "seg", 1 * MiB, "--token", "right-secret")
    try:
        for token in (None, "wrong-secret"):
            eng = make_engine(token=token)
            with pytest.raises(AuthError):
                eng.open_segment(owner.info["address"], "disk")
        eng = make_engine(token="right-secret")
        rs = eng.open_segment(owner.info["address"], "disk")
        ls = eng.register(pattern(4, 0, 4096))
        eng.write(ls, 0, rs, 4096, 4096)
        assert (_file_bytes(str(tmp_path / "seg"), 4096, 4096) == ls.array()).all()
    finally:
        owner.close()


def test_durable_writes_are_synced_before_they_are_acknowledged(make_engine, tmp_path, monkeypatch):
    calls: list[int] = []
    real = os.fdatasync

    def counted(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counted)
    eng = make_engine()
    plain = eng.register_disk(tmp_path / "plain", 1 * MiB, name="plain")
    durable = eng.register_disk(tmp_path / "durable", 1 * MiB, name="durable", durable=True)
    ls = eng.register(pattern(5, 0, 64 << 10))
    eng.write(ls, 0, eng.open_segment(eng.address, "plain"), 0, 64 << 10)
    assert calls == []  # acknowledged writes are not durable by themselves
    eng.sync_segment(eng.open_segment(eng.address, "plain"))
    assert len(calls) == 1
    eng.write(ls, 0, eng.open_segment(eng.address, "durable"), 3, 60 << 10)
    assert len(calls) == 2
    assert plain.durable is False and durable.durable is True
    # Through the owner: a durable owner syncs before its Ack; sync_segment travels.
    owner = _disk_peer(tmp_path / "remote", 1 * MiB, "--durable")
    try:
        rs = eng.open_segment(owner.info["address"], "disk")
        assert owner.call("syncs")["syncs"] == 0
        eng.write(ls, 0, rs, 5, 40 << 10)
        assert owner.call("syncs")["syncs"] == 1
        eng.sync_segment(rs)
        assert owner.call("syncs")["syncs"] == 2
    finally:
        owner.close()


def test_checksum_mismatch_detected_on_a_corrupted_copy(make_engine, tmp_path):
    eng = make_engine()
    seg = eng.register_disk(tmp_path / "seg", 4 * MiB, name="d")
    objs = [(0, 256 << 10), (256 << 10, 4096), (300_001, 1 * MiB), (2 * MiB, 1 * MiB)]
    src = pattern(6, 0, 4 * MiB)
    ls = eng.register(src)
    rs = eng.open_segment(eng.address, "d")
    offs = np.array([o for o, _ in objs])
    lens = np.array([n for _, n in objs])
    eng.transfer(Op.WRITE, ls, offs, rs, offs, lens)
    eng.sync_segment(rs)
    recorded = D.checksums(src, offs, lens)  # what the store keeps per replica
    eng.unregister(seg)
    # A planted corrupted copy of the file: one bit of the third object flipped.
    shutil.copyfile(tmp_path / "seg", tmp_path / "copy")
    with open(tmp_path / "copy", "r+b") as f:
        f.seek(300_001 + 777)
        b = f.read(1)
        f.seek(300_001 + 777)
        f.write(bytes([b[0] ^ 0x10]))
    for name, bad in (("seg", []), ("copy", [2])):
        again = eng.register_disk(tmp_path / name, 4 * MiB, name=name)  # existing bytes kept
        r = eng.open_segment(eng.address, name)
        dst = np.zeros(4 * MiB, np.uint8)
        ld = eng.register(dst)
        eng.transfer(Op.READ, ld, offs, r, offs, lens)
        if bad:
            with pytest.raises(D.ChecksumMismatch) as info:
                D.verify(dst, offs, lens, recorded)
            assert info.value.bad.tolist() == bad
        else:
            D.verify(dst, offs, lens, recorded)
        # The owner computes the same checksums without moving the bytes.
        where = np.flatnonzero(eng.checksum_segment(r, offs, lens) != recorded).tolist()
        assert where == bad
        eng.unregister(ld)
        eng.unregister(again)


def test_unusable_paths_give_clear_errors(make_engine, tmp_path):
    eng = make_engine()
    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(InvalidArgument, match="not writable|not usable"):
        eng.register_disk(tmp_path / "afile" / "seg", 1 * MiB, name="a")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.geteuid() != 0:  # root writes through mode bits
            with pytest.raises(InvalidArgument, match="not writable"):
                eng.register_disk(ro / "seg", 1 * MiB, name="b")
    finally:
        ro.chmod(0o700)
    with pytest.raises(InvalidArgument, match="not a regular file"):
        eng.register_disk("/dev/null", 1 * MiB, name="c")
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    with pytest.raises(InvalidArgument, match="bytes free"):
        eng.register_disk(tmp_path / "huge", free + (1 << 30), name="d")
    assert not (tmp_path / "huge").exists()  # refused before anything was made
    eng.register_disk(tmp_path / "one", 1 * MiB, name="e")
    with pytest.raises(InvalidArgument, match="in use"):
        eng.register_disk(tmp_path / "one", 1 * MiB, name="f")
    assert [d.name for d in eng.segments()] == ["e"]


def test_unregister_ends_the_segment_and_keeps_the_file(make_engine, tmp_path):
    eng = make_engine()
    seg = eng.register_disk(tmp_path / "seg", 1 * MiB, name="d")
    rs = eng.open_segment(eng.address, "d")
    ls = eng.register(pattern(7, 0, 8192))
    eng.write(ls, 0, rs, 100, 8192)
    eng.unregister(seg)
    with pytest.raises(SegmentNotFound):
        eng.read(ls, 0, rs, 100, 8192)
    # The same path registered again (a node restart) finds its bytes.
    eng.register_disk(tmp_path / "seg", 1 * MiB, name="d")
    dst = eng.register(np.zeros(8192, np.uint8))
    eng.read(dst, 0, eng.open_segment(eng.address, "d"), 100, 8192)
    assert (dst.array() == ls.array()).all()


def test_a_truncated_file_is_an_error_never_other_bytes(make_engine, tmp_path):
    owner = _disk_peer(tmp_path / "remote", 4 * MiB)
    try:
        eng = make_engine()
        local = eng.register_disk(tmp_path / "local", 4 * MiB, name="local")
        ls = eng.register(pattern(8, 0, 4 * MiB))
        ld = eng.register(np.zeros(4 * MiB, np.uint8))
        for path, rs in (
            (tmp_path / "local", eng.open_segment(eng.address, "local")),
            (tmp_path / "remote", eng.open_segment(owner.info["address"], "disk")),
        ):
            eng.write(ls, 0, rs, 0, 4 * MiB)
            os.truncate(path, 1 * MiB)  # the file lost its tail under the segment
            with pytest.raises(TransferError, match="short read"):
                eng.read(ld, 0, rs, 2 * MiB, 1 * MiB)
            with pytest.raises(TransferError, match="short read"):
                eng.checksum_segment(rs, [2 * MiB], [4096])
            # The owner answered in step: the same connection serves the next request.
            eng.read(ld, 0, rs, 4096, 8192)
            assert (ld.array()[:8192] == ls.array()[4096 : 4096 + 8192]).all()
        assert local.size == 4 * MiB
    finally:
        owner.close()


def test_address_lookups_never_land_in_a_disk_segment(make_engine, tmp_path):
    owner, me = make_engine(), make_engine()
    owner.register_disk(tmp_path / "seg", 64 * MiB, name="disk")  # [0, 64 MiB) by offset
    pool = owner.register(np.zeros(1 * MiB, np.uint8), name="pool")
    ls = me.register(pattern(9, 0, 4096))
    with pytest.raises(SegmentNotFound):
        me.transfer_by_address(Op.WRITE, owner.address, [ls.ptr], [4096], [4096])
    me.transfer_by_address(Op.WRITE, owner.address, [ls.ptr], [pool.ptr + 8192], [4096])
    assert (pool.array()[8192 : 8192 + 4096] == ls.array()).all()


def test_owner_killed_mid_read_is_peer_dead(make_engine, tmp_path):
    owner = _disk_peer(tmp_path / "seg", 64 * MiB)
    try:
        eng = make_engine()
        rs = eng.open_segment(owner.info["address"], "disk")
        ld = eng.register(np.zeros(64 * MiB, np.uint8))
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                while True:
                    eng.read(ld, 0, rs, 0, 64 * MiB, timeout=30)
            except BaseException as exc:  # noqa: BLE001 - the test looks at it
                errors.append(exc)

        t = threading.Thread(target=reader)
        t.start()
        time.sleep(0.3)
        owner.proc.kill()
        owner.proc.wait(10)  # reaped: close() then sends it nothing
        t.join(20)
        assert not t.is_alive()
        assert isinstance(errors[0], (PeerDeadError, SegmentNotFound)), errors
    finally:
        owner.close()


def test_unregister_waits_for_jobs_and_no_write_lands_after(make_engine, tmp_path):
    """Once ``unregister`` returns, the files are closed and no job writes any more: a write
    still running on a closed descriptor number could land in whatever file reuses it."""
    eng = make_engine()
    seg = eng.register_disk(tmp_path / "seg", 64 * MiB, name="d")
    rs = eng.open_segment(eng.address, "d")
    ls = eng.register(_aligned(np.full(32 * MiB, 0x77, np.uint8)))
    ended: list[BaseException] = []

    # Many separate pieces per job: descriptors are used again and again within one job.
    lo = np.arange(2048, dtype=np.int64) * (16 << 10)
    ro = lo * 2 + 4096

    def writer() -> None:
        try:
            while True:
                eng.transfer(Op.WRITE, ls, lo, rs, ro, 16 << 10)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            ended.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    eng.unregister(seg)
    # Descriptors closed by unregister are reused at once by these files.
    others = []
    for i in range(8):
        f = open(tmp_path / f"other{i}", "w+b")  # noqa: SIM115 - closed below
        f.write(b"\0" * MiB)  # a write landing in it at any offset shows up below
        f.flush()
        others.append(f)
    for t in threads:
        t.join(20)
    try:
        for f in others:
            f.seek(0)
            assert f.read().count(0x77) == 0, f.name
    finally:
        for f in others:
            f.close()
    assert len(ended) == 2 and all(isinstance(e, SegmentNotFound) for e in ended), ended


def test_owner_unregister_cuts_a_peer_mid_stream(make_engine, tmp_path):
    owner = _disk_peer(tmp_path / "seg", 64 * MiB)
    try:
        eng = make_engine()
        rs = eng.open_segment(owner.info["address"], "disk")
        ls = eng.register(np.full(64 * MiB, 0x33, np.uint8))
        errors: list[BaseException] = []

        def writer() -> None:
            try:
                while True:
                    eng.write(ls, 0, rs, 0, 64 * MiB, timeout=30)
            except BaseException as exc:  # noqa: BLE001 - the test looks at it
                errors.append(exc)

        t = threading.Thread(target=writer)
        t.start()
        time.sleep(0.3)
        assert owner.call("unregister", timeout=30) == {"ok": True}
        t.join(20)
        assert not t.is_alive()
        assert isinstance(errors[0], SegmentNotFound), errors
    finally:
        owner.close()
