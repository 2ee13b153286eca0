"""DiskStorage: durable log + hard state + snapshots, recovery, and file-level faults
(torn tails, bit flips, crashes between snapshot rename and WAL compaction, unsynced loss)."""

import os
import random
import shutil

import pytest

from kvmesh.replog.storage import snapfile
from kvmesh.replog.storage import wal as walmod
from kvmesh.replog.storage.disk import DiskStorage, StorageCorruptionError, StorageLockedError
from kvmesh.replog.storage.memory import MemoryStorage
from kvmesh.replog.storage.wal import WalFatalError
from kvmesh.replog.types import (
    ConfState,
    Entry,
    HardState,
    LogCompacted,
    LogStorage,
    LogUnavailable,
    Ready,
    Snapshot,
    SnapshotMeta,
    StorageError,
)

CS = ConfState(voters=(1, 2, 3))


def ents(lo, hi, term=1, size=20):
    return [Entry(term, i, 0, b"%d:" % i + b"x" * size) for i in range(lo, hi)]


def wal_files(st):
    return sorted(os.path.join(st.wal_dir, n) for n in os.listdir(st.wal_dir))


def test_bootstrap_and_roundtrip(tmp_path):
    d = str(tmp_path / "n1")
    st = DiskStorage.open(d, bootstrap_voters=[1, 2, 3])
    assert isinstance(st, LogStorage)
    assert st.last_index() == 3 and st.hard_state == HardState(1, 0, 3)
    st.append(ents(4, 50, term=2))
    st.set_hard_state(HardState(2, 1, 40))
    st.sync()
    st.close()
    st = DiskStorage.open(d, bootstrap_voters=[1, 2, 3])  # not re-bootstrapped
    assert st.first_index() == 1 and st.last_index() == 49
    assert st.hard_state == HardState(2, 1, 40)
    assert st.entries(4, 50) == ents(4, 50, term=2)
    assert st.term(3) == 1 and st.term(4) == 2
    with pytest.raises(LogUnavailable):
        st.term(50)
    # max_bytes limits but always returns one entry.
    assert len(st.entries(4, 50, max_bytes=1)) == 1
    st.close()


def test_conflicting_suffix_replacement_is_durable(tmp_path):
    d = str(tmp_path / "n")
    st = DiskStorage.open(d)
    st.append(ents(1, 11, term=1))
    st.sync()
    st.append(ents(8, 10, term=2))  # a new leader overwrote 8.. with a shorter log
    st.sync()
    assert st.last_index() == 9
    st.close()
    st = DiskStorage.open(d)
    assert st.last_index() == 9
    assert [st.term(i) for i in range(1, 10)] == [1] * 7 + [2, 2]
    with pytest.raises(StorageError, match="gap"):
        st.append(ents(20, 21))
    st.close()


def test_persist_ready_is_one_fsync(tmp_path):
    st = DiskStorage.open(str(tmp_path / "n"))
    before = st.wal.fsyncs
    st.persist(Ready(hard_state=HardState(1, 2, 0), entries_to_append=ents(1, 200), must_sync=True))
    assert st.wal.fsyncs == before + 1
    # A commit-only hard state change needs no fsync (the commit index is relearned).
    st.persist(Ready(hard_state=HardState(1, 2, 100), must_sync=False))
    assert st.wal.fsyncs == before + 1
    st.close()
    st = DiskStorage.open(str(tmp_path / "n"))
    assert st.hard_state == HardState(1, 2, 100)  # close() synced it
    st.close()


def test_torn_tail_loses_only_unsynced_batch(tmp_path):
    d = str(tmp_path / "n")
    st = DiskStorage.open(d)
    st.append(ents(1, 21))
    st.set_hard_state(HardState(1, 1, 20))
    st.sync()
    (seg,) = wal_files(st)
    synced = os.path.getsize(seg)
    st.append(ents(21, 41))  # never synced
    st._wal._flush()  # in the file (the next sync's write, without its fdatasync)
    total = os.path.getsize(seg)
    assert total > synced
    st._wal._fd and os.close(st._wal._fd)  # crash: no close/sync
    st._wal._fd = -1
    os.close(st._lock_fd)
    st._lock_fd = -1
    # The crash tore the unsynced record in the middle.
    with open(seg, "r+b") as f:
        f.truncate(synced + (total - synced) // 2)
    st = DiskStorage.open(d)
    assert st.last_index() == 20 and st.hard_state.commit == 20
    assert st.wal.truncated_bytes > 0
    st.append(ents(21, 23, term=2))
    st.sync()
    st.close()
    st = DiskStorage.open(d)
    assert st.last_index() == 22 and st.term(22) == 2
    st.close()


def test_bit_flip_in_middle_refuses_to_start(tmp_path):
    d = str(tmp_path / "n")
    st = DiskStorage.open(d)
    for lo in range(1, 100, 10):
        st.append(ents(lo, lo + 10))
        st.sync()
    st.close()
    (seg,) = [f for f in os.listdir(os.path.join(d, "wal"))]
    path = os.path.join(d, "wal", seg)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(StorageCorruptionError, match="corruption in the middle"):
        DiskStorage.open(d)


def test_lock_prevents_second_opener(tmp_path):
    d = str(tmp_path / "n")
    st = DiskStorage.open(d)
    with pytest.raises(StorageLockedError):
        DiskStorage.open(d)
    st.close()
    DiskStorage.open(d).close()


def _fill(st, n, per_batch=25, term=1):
    lo = st.last_index() + 1
    while lo <= n:
        hi = min(n + 1, lo + per_batch)
        st.append(ents(lo, hi, term=term, size=60))
        st.sync()
        lo = hi
    st.set_hard_state(HardState(term, 1, n))
    st.sync()


def test_snapshot_compaction_and_recovery(tmp_path):
    d = str(tmp_path / "n")
    st = DiskStorage.open(d, segment_bytes=4096)
    _fill(st, 1000)
    nseg = len(wal_files(st))
    assert nseg > 10
    snap = st.create_snapshot(800, CS, b"state@800")
    assert snap.meta == SnapshotMeta(800, 1, CS)
    with pytest.raises(StorageError, match="newest snapshot"):
        st.compact(900)
    st.compact(700)  # keep 100 trailing entries before the snapshot
    assert st.first_index() == 701
    with pytest.raises(LogCompacted):
        st.entries(600, 700)
    assert len(wal_files(st)) < nseg
    st.close()
    st = DiskStorage.open(d, segment_bytes=4096)
    # After a restart the log starts right after the snapshot (the core derives the
    # snapshot index from first_index()); the entries after it are all there.
    assert st.first_index() == 801
    assert st.last_index() == 1000
    assert st.entries(801, 1001) == ents(801, 1001, size=60)
    assert st.snapshot() == Snapshot(SnapshotMeta(800, 1, CS), b"state@800")
    assert st.initial_state() == (HardState(1, 1, 1000), CS)
    st.append(ents(1001, 1010, term=2, size=60))
    st.sync()
    st.close()
    st = DiskStorage.open(d, segment_bytes=4096)
    assert st.last_index() == 1009
    st.close()


def test_crash_between_snapshot_rename_and_compaction(tmp_path):
    d = str(tmp_path / "n")
    st = DiskStorage.open(d, segment_bytes=4096)
    _fill(st, 500)
    st.create_snapshot(300, CS, b"old@300")
    st.compact(250)
    # A newer snapshot file reached its final name, then the process died before it was
    # registered and before the WAL was compacted.
    snap, path = st.prepare_snapshot(450, CS, b"new@450")
    assert os.path.exists(path)
    image = str(tmp_path / "image")
    shutil.copytree(d, image)
    st.close()
    st = DiskStorage.open(image, segment_bytes=4096)
    assert st.snapshot().meta.index == 450 and st.snapshot().data == b"new@450"
    assert st.last_index() == 500
    assert st.entries(451, 501) == ents(451, 501, size=60)
    assert st.first_index() == 451
    st.close()
    # Had the newer file been damaged, the older snapshot + the uncompacted WAL still work.
    image2 = str(tmp_path / "image2")
    shutil.copytree(image, image2)
    newest = snapfile.list_snapshots(os.path.join(image2, "snap"))[-1]
    _corrupt_snapshot(newest.path)
    st = DiskStorage.open(image2, segment_bytes=4096)
    assert st.snapshot().data == b"old@300" and st.first_index() == 301
    assert st.entries(301, 501) == ents(301, 501, size=60)
    st.close()


def test_partial_snapshot_tmp_is_ignored(tmp_path):
    d = str(tmp_path / "n")
    st = DiskStorage.open(d)
    _fill(st, 100)
    st.create_snapshot(50, CS, b"s50")
    st.close()
    tmp = os.path.join(d, "snap", f"snap-{90:016x}-{1:016x}.snap.tmp")
    with open(tmp, "wb") as f:
        f.write(b"KVMSNAP1garbage")  # crashed mid-write
    st = DiskStorage.open(d)
    assert not os.path.exists(tmp)
    assert st.snapshot().meta.index == 50
    st.close()


def _corrupt_snapshot(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 30)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))


def test_damaged_newest_snapshot_falls_back_when_wal_covers(tmp_path):
    d = str(tmp_path / "n")
    st = DiskStorage.open(d)
    _fill(st, 300)
    st.create_snapshot(100, CS, b"s100" * 100)
    st.create_snapshot(200, CS, b"s200" * 100)
    st.close()  # no compaction: the WAL still holds everything after 100
    newest = snapfile.list_snapshots(os.path.join(d, "snap"))[-1]
    _corrupt_snapshot(newest.path)
    st = DiskStorage.open(d)
    assert st.snapshot().meta.index == 100
    assert st.last_index() == 300 and st.entries(101, 301) == ents(101, 301, size=60)
    st.close()


def test_damaged_snapshot_with_compacted_wal_fails_stop(tmp_path):
    d = str(tmp_path / "n")
    st = DiskStorage.open(d, segment_bytes=2048)
    _fill(st, 600)
    st.create_snapshot(100, CS, b"s100" * 100)
    st.create_snapshot(500, CS, b"s500" * 100)
    st.compact(450)
    st.close()
    newest = snapfile.list_snapshots(os.path.join(d, "snap"))[-1]
    assert newest.index == 500
    _corrupt_snapshot(newest.path)
    with pytest.raises(
        StorageCorruptionError, match="older than the WAL's first retained index.*damaged"
    ):
        DiskStorage.open(d, segment_bytes=2048)


def test_installed_snapshot_replaces_log(tmp_path):
    d = str(tmp_path / "n")
    st = DiskStorage.open(d)
    _fill(st, 50)
    st.append(ents(51, 60, term=1))  # divergent, uncommitted tail
    st.sync()
    snap = Snapshot(SnapshotMeta(1000, 7, CS), b"leader-state")
    st.persist(Ready(snapshot_to_install=snap, hard_state=HardState(7, 0, 1000), must_sync=True))
    assert st.first_index() == 1001 and st.last_index() == 1000 and st.term(1000) == 7
    st.append(ents(1001, 1005, term=7))
    st.sync()
    st.close()
    st = DiskStorage.open(d)
    assert st.snapshot() == snap
    assert st.first_index() == 1001 and st.last_index() == 1004
    assert st.hard_state == HardState(7, 0, 1000)
    with pytest.raises(StorageError, match="older"):
        st.apply_snapshot(Snapshot(SnapshotMeta(10, 1, CS), b""))
    st.close()


def test_crash_after_install_file_before_wal_marker(tmp_path):
    d = str(tmp_path / "n")
    st = DiskStorage.open(d)
    _fill(st, 50)
    st.close()
    # The snapshot file was renamed into place; the Installed marker never hit the WAL.
    snapfile.write_snapshot(os.path.join(d, "snap"), Snapshot(SnapshotMeta(80, 3, CS), b"img"))
    st = DiskStorage.open(d)
    assert st.first_index() == 81 and st.last_index() == 80 and st.term(80) == 3
    assert st.hard_state.commit == 80
    st.close()


def test_snapshot_at_diverged_index_resets_log(tmp_path):
    d = str(tmp_path / "n")
    st = DiskStorage.open(d)
    _fill(st, 50, term=1)
    st.set_hard_state(HardState(1, 1, 30))  # 31..50 were never committed
    st.close()
    snapfile.write_snapshot(os.path.join(d, "snap"), Snapshot(SnapshotMeta(40, 2, CS), b"img"))
    st = DiskStorage.open(d)
    # Our entry 40 has term 1, the snapshot says 2: our tail after it is not the leader's.
    assert st.last_index() == 40 and st.term(40) == 2 and st.hard_state.commit == 40
    st.close()


def test_commit_beyond_durable_log_is_detected(tmp_path):
    d = str(tmp_path / "n")
    st = DiskStorage.open(d)
    _fill(st, 50, term=1)
    st.close()
    # A snapshot claiming a different term at a *committed* index: impossible in Raft.
    snapfile.write_snapshot(os.path.join(d, "snap"), Snapshot(SnapshotMeta(40, 2, CS), b"img"))
    with pytest.raises(StorageCorruptionError, match="commit 50 is beyond"):
        DiskStorage.open(d)


def test_fsync_error_is_fatal_for_storage(tmp_path, monkeypatch):
    st = DiskStorage.open(str(tmp_path / "n"))
    st.append(ents(1, 5))

    def eio(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(walmod.os, "fdatasync", eio)
    with pytest.raises(WalFatalError):
        st.persist(Ready(entries_to_append=ents(5, 6), must_sync=True))
    monkeypatch.undo()
    with pytest.raises(WalFatalError):
        st.append(ents(6, 7))
    st.close()


def _crash(st):
    """Drop the storage without closing/syncing (the page cache is kept by our process, so
    the caller decides what "reached the disk")."""
    os.close(st._wal._fd)
    st._wal._fd = -1
    os.close(st._lock_fd)
    st._lock_fd = -1


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_ops_match_memory_storage_and_survive_crashes(tmp_path, seed):
    """Random appends (with overwrites of the uncommitted tail), hard states, snapshots and
    compactions, checked against MemoryStorage. At random points the node "crashes" and the
    un-fsynced bytes are partly lost (a torn tail, or a new segment file that vanished);
    recovery must keep everything that was synced."""
    rng = random.Random(seed)
    d = str(tmp_path / "n")
    SEG = 3000
    st = DiskStorage.open(d, segment_bytes=SEG)
    ref = MemoryStorage()
    durable = {}  # segment path -> size known to be on disk
    synced_ref = ref.copy()
    term = 1
    crashes = 0

    def instrument(st):
        # Track what really reached the disk, including the syncs done inside rotations.
        wal = st.wal
        real_sync = wal.sync

        def sync():
            real_sync()
            durable.clear()
            durable.update({seg.path: os.path.getsize(seg.path) for seg in wal.segments})

        wal.sync = sync
        return st

    def mark_synced():
        nonlocal synced_ref
        synced_ref = ref.copy()

    instrument(st)

    for step in range(600):
        r = rng.random()
        last = ref.last_index()
        floor = max(ref.hard_state.commit, ref.snapshot().meta.index)
        if r < 0.55:
            lo = max(floor + 1, last + 1 - rng.randrange(0, 4))
            if rng.random() < 0.2:
                term += 1
            new = ents(lo, lo + rng.randrange(1, 15), term=term, size=rng.randrange(0, 80))
            st.append(new)
            ref.append(new)
        elif r < 0.7:
            hs = HardState(
                term,
                rng.randrange(0, 4),
                rng.randrange(ref.hard_state.commit, ref.last_index() + 1),
            )
            st.set_hard_state(hs)
            ref.set_hard_state(hs)
        elif r < 0.85:
            st.sync()
            mark_synced()
        elif r < 0.92:
            c = ref.hard_state.commit
            if c > ref.snapshot().meta.index and c >= ref.first_index():
                st.sync()
                st.create_snapshot(c, CS, b"snap%d" % c)
                ref.create_snapshot(c, CS, b"snap%d" % c)
                keep = max(ref.first_index() - 1, c - rng.randrange(0, 30))
                st.compact(keep)
                ref.compact(keep)
                mark_synced()
        else:
            crashes += 1
            segs = st.wal.segments
            _crash(st)
            for seg in segs:
                size = os.path.getsize(seg.path)
                if seg.path not in durable:
                    # Created after the last sync: the directory entry may not have survived.
                    if rng.random() < 0.3:
                        os.unlink(seg.path)
                        continue
                    lo = 0
                else:
                    lo = durable[seg.path]
                with open(seg.path, "r+b") as f:
                    f.truncate(rng.randrange(lo, size + 1))
            st = instrument(DiskStorage.open(d, segment_bytes=SEG))
            st.sync()
            c = synced_ref.hard_state.commit
            assert st.last_index() >= c, (step, st.last_index(), c)
            for i in range(max(st.first_index(), synced_ref.first_index()), c + 1):
                assert st.term(i) == synced_ref.term(i), (step, i)
            assert st.hard_state.term >= synced_ref.hard_state.term
            assert st.snapshot().meta.index >= synced_ref.snapshot().meta.index
            # Continue from what survived.
            snap = st.snapshot()
            ref = MemoryStorage(st.hard_state, snap)
            ref.append(st.entries(snap.meta.index + 1, st.last_index() + 1))
            term = max(term, st.hard_state.term)
            mark_synced()
            continue
        # Read API parity with the reference.
        assert st.last_index() == ref.last_index(), step
        lo = max(st.first_index(), ref.first_index())
        assert st.entries(lo, ref.last_index() + 1) == ref.entries(lo, ref.last_index() + 1)
        assert st.hard_state == ref.hard_state
        assert st.snapshot() == ref.snapshot()
    assert crashes > 20
    st.close()


def test_snapshot_image_loaded_lazily_from_file(tmp_path):
    from kvmesh.replog.storage import snapfile as sf

    st = DiskStorage.open(str(tmp_path / "n"))
    _fill(st, 100)
    meta = SnapshotMeta(80, 1, CS)
    path = sf.write_snapshot(st.snap_dir, Snapshot(meta), parts=[b"ab", b"cd"])
    st.commit_snapshot(Snapshot(meta), path, keep_data=False)
    assert st._snap_data is None  # not held in memory
    assert st.snapshot() == Snapshot(meta, b"abcd")  # read from the file on demand
    # A damaged file is reported as corruption, not served.
    st._snap_data = None
    _corrupt_snapshot(path)
    with pytest.raises(StorageCorruptionError):
        st.snapshot()
    st.close()


def test_pruning_never_touches_snapshots_being_written(tmp_path):
    from kvmesh.replog.storage import snapfile as sf

    st = DiskStorage.open(str(tmp_path / "n"))
    _fill(st, 100)
    for i in (10, 20, 30):
        st.create_snapshot(i, CS, b"s%d" % i)
    names = lambda: sorted(f.index for f in sf.list_snapshots(st.snap_dir))  # noqa: E731
    assert names() == [20, 30]  # two kept
    # A snapshot file above the current one (an install or local snapshot still being
    # registered) survives pruning triggered meanwhile.
    sf.write_snapshot(st.snap_dir, Snapshot(SnapshotMeta(90, 1, CS), b"in-flight"))
    st.create_snapshot(40, CS, b"s40")
    assert names() == [30, 40, 90]
    st.defer_pruning = True
    st.create_snapshot(50, CS, b"s50")
    assert names() == [30, 40, 50, 90]
    assert st.obsolete_snapshot_files() == [
        os.path.join(st.snap_dir, f"snap-{30:016x}-{1:016x}.snap")
    ]
    st.close()
