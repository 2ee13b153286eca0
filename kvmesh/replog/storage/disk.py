"""Durable :class:`~kvmesh.replog.types.LogStorage`: a WAL (``wal.py``) plus snapshot files
(``snapfile.py``) under one data directory, with an in-memory copy of the retained log.

Layout::

    DIR/LOCK               flock'ed while open (one process per data directory)
    DIR/wal/*.wal          records: Entries, HardState, Base (segment preamble), Installed
    DIR/snap/*.snap        the newest snapshots (two are kept)

Write side (same names as ``MemoryStorage``): :meth:`append`, :meth:`set_hard_state`,
:meth:`apply_snapshot`, plus :meth:`sync` (one fdatasync: group commit) and
:meth:`persist` (a whole Ready, one fsync). Local snapshots: :meth:`create_snapshot`, or the
two halves :meth:`prepare_snapshot` (pure, call from any thread: builds the Snapshot and
writes its file) and :meth:`commit_snapshot`, then :meth:`compact`.

Recovery (:meth:`open`), per docs/replog.md, "Durability rules (as implemented)":

1. remove partial snapshot temp files; load the newest snapshot that verifies (an older
   one only if the WAL still covers the gap, else fail stop);
2. replay the WAL (torn tail truncated, corruption elsewhere is fatal): entries (an entry
   at index i replaces the log from i), hard state, installed-snapshot markers;
3. reconcile: a snapshot newer than the log (or disagreeing with it at its index) replaces
   the log; the hard state's commit is raised to the snapshot index.

Every write or fsync failure raises :class:`~kvmesh.replog.storage.wal.WalFatalError` (or the
``OSError`` of a snapshot write): the node must stop.

Compaction removes whole WAL segments whose entries are all at or below the compaction
index. Each segment starts with a preamble (``Base`` = last index/term when it was opened,
and the current hard state), so the remaining suffix of segments is always self-contained.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import msgspec

from ..errors import StorageCorruptionError, StorageLockedError
from ..types import (
    ConfState,
    Entry,
    HardState,
    LogUnavailable,
    Ready,
    Snapshot,
    SnapshotMeta,
    StorageError,
    bootstrap_entries,
)
from . import snapfile
from .memory import EntryLog, ReadyWriter
from .snapfile import SnapshotCorruptionError
from .wal import Wal, WalCorruptionError, fsync_dir

__all__ = ["DiskStorage", "StorageCorruptionError", "StorageLockedError"]

log = logging.getLogger(__name__)


def remove_files(dirpath: str, paths: list[str]) -> None:
    """Unlink ``paths`` (missing ones are fine) and make it durable."""
    n = 0
    for p in paths:
        try:
            os.unlink(p)
            n += 1
        except FileNotFoundError:
            pass
    if n:
        fsync_dir(dirpath)


class _WEntries(msgspec.Struct, tag=1, array_like=True):
    entries: list[Entry]


class _WHardState(msgspec.Struct, tag=2, array_like=True):
    hs: HardState


class _WBase(msgspec.Struct, tag=3, array_like=True):
    """Segment preamble: the log's last (index, term) when the segment was started."""

    index: int
    term: int


class _WInstalled(msgspec.Struct, tag=4, array_like=True):
    """A snapshot received from the leader was made durable: the log restarts after it."""

    index: int
    term: int


_Record = _WEntries | _WHardState | _WBase | _WInstalled
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(_Record)


class DiskStorage(EntryLog, ReadyWriter):
    """Durable log storage in directory ``path``; create with :meth:`open`."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.wal_dir = os.path.join(path, "wal")
        self.snap_dir = os.path.join(path, "snap")
        self._hs = HardState()
        self._snap_meta = SnapshotMeta()
        self._snap_data: bytes | None = b""
        self._snap_path: str | None = None
        self._seg_max: dict[int, int] = {}  # WAL segment seq -> highest entry index in it
        self._wal: Wal | None = None
        self._lock_fd = -1
        self.keep_snapshots = 2
        # A driver that deletes obsolete_snapshot_files() itself (e.g. in a worker thread,
        # to keep large unlinks off its event loop) sets this.
        self.defer_pruning = False

    # ------------------------------------------------------------------ open / recovery

    @classmethod
    def open(
        cls,
        path: str,
        *,
        bootstrap_voters: list[int] | tuple[int, ...] | None = None,
        bootstrap_learners: list[int] | tuple[int, ...] = (),
        segment_bytes: int = 64 << 20,
    ) -> DiskStorage:
        """Open and recover ``path``. If it holds no state and ``bootstrap_voters`` is given,
        durably write the founding log prefix (:func:`~kvmesh.replog.types.bootstrap_entries`).

        Raises :class:`StorageCorruptionError` / :class:`StorageLockedError`."""
        os.makedirs(path, exist_ok=True)
        s = cls(path)
        s._lock()
        try:
            s._recover(segment_bytes)
            if bootstrap_voters is not None and s.is_empty():
                ents, hs = bootstrap_entries(bootstrap_voters, bootstrap_learners)
                s.append(ents)
                s.set_hard_state(hs)
                s.sync()
        except BaseException:
            s.close()
            raise
        return s

    def _lock(self) -> None:
        fd = os.open(os.path.join(self.path, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StorageLockedError(
                f"data directory {self.path} is in use by another process"
            ) from None
        self._lock_fd = fd

    def is_empty(self) -> bool:
        return self.last_index() == 0 and self._hs == HardState() and self._snap_meta.index == 0

    def _recover(self, segment_bytes: int) -> None:
        os.makedirs(self.snap_dir, exist_ok=True)
        snapfile.cleanup_tmp(self.snap_dir)
        candidates = snapfile.list_snapshots(self.snap_dir)
        snaps: list[Snapshot] = []
        errors: list[str] = []
        # Newest first; keep the failures to explain a refusal to start.
        for info in reversed(candidates):
            try:
                snaps.append(snapfile.read_snapshot(info.path))
                self._snap_path = info.path
                break
            except SnapshotCorruptionError as e:
                errors.append(str(e))
                log.error("skipping damaged snapshot: %s", e)

        try:
            wal = Wal.open(self.wal_dir, segment_bytes=segment_bytes, preamble=self._preamble)
        except WalCorruptionError as e:
            raise StorageCorruptionError(f"{self.path}: {e}") from e
        self._wal = wal

        ents: list[Entry] = [Entry(0, 0)]
        hs = HardState()
        first_record = True
        for seq, payload in wal.replay():
            try:
                rec = _dec.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise StorageCorruptionError(
                    f"{self.path}: WAL record undecodable (CRC was fine): {e}"
                ) from e
            t = type(rec)
            if t is _WEntries:
                new = rec.entries
                if not new:
                    continue
                off = ents[0].index
                first = new[0].index
                last = off + len(ents) - 1
                if first > last + 1:
                    raise StorageCorruptionError(
                        f"{self.path}: WAL entries from {first} "
                        f"leave a gap after the log ({off + 1}..{last})"
                    )
                if first <= off:
                    # An overwrite of the uncommitted tail, written when this segment's base
                    # was not yet compacted. Everything at or below the base is covered by a
                    # snapshot by now (the older segments were deleted), so only the base's
                    # (index, term) matters: it moves to where the overwrite leaves it.
                    top = new[-1].index
                    pivot = min(off, top)
                    ents = [Entry(new[pivot - first].term, pivot)]
                    ents.extend(new[pivot + 1 - first :])
                else:
                    del ents[first - off :]
                    ents.extend(new)
                self._seg_max[seq] = max(self._seg_max.get(seq, 0), new[-1].index)
            elif t is _WHardState:
                hs = rec.hs
            elif t is _WBase:
                # Only the oldest remaining segment's preamble defines where the log starts;
                # later preambles repeat what the replay already knows.
                if first_record:
                    ents = [Entry(rec.term, rec.index)]
            elif t is _WInstalled:
                ents = [Entry(rec.term, rec.index)]
            first_record = False

        snap = snaps[0] if snaps else None
        if snap is None and errors:
            if ents[0].index != 0:
                raise StorageCorruptionError(
                    f"{self.path}: no usable snapshot ({'; '.join(errors)}) "
                    "and the WAL starts after "
                    f"index {ents[0].index}: state cannot be rebuilt"
                )
            log.warning("%s: all snapshots damaged, rebuilding from the complete WAL", self.path)
        if snap is not None:
            m = snap.meta
            off = ents[0].index
            last = off + len(ents) - 1
            if m.index < off:
                raise StorageCorruptionError(
                    f"{self.path}: snapshot at index {m.index} "
                    "is older than the WAL's first retained "
                    f"index {off + 1}: entries in between are gone"
                    + (f" (newer snapshots were damaged: {'; '.join(errors)})" if errors else "")
                )
            if m.index > last or ents[m.index - off].term != m.term:
                # The snapshot supersedes the log (installed from a leader; crash before the
                # Installed marker, or the log diverged after it).
                ents = [Entry(m.term, m.index)]
            else:
                # Start the in-memory log right after the snapshot: the core derives the
                # snapshot index from first_index() and replays membership changes above it.
                ents = ents[m.index - off :]
                ents[0] = Entry(m.term, m.index)
            self._snap_meta = m
            self._snap_data = snap.data
            if hs.commit < m.index:
                hs = HardState(hs.term, hs.vote, m.index)
        last = ents[0].index + len(ents) - 1
        if hs.commit > last:
            raise StorageCorruptionError(
                f"{self.path}: hard state commit {hs.commit} "
                f"is beyond the last durable entry {last}"
            )
        self._ents = ents
        self._hs = hs

    def _preamble(self) -> list[bytes]:
        last = self.last_index()
        return [
            _enc.encode(_WBase(last, self.term(last))),
            _enc.encode(_WHardState(self._hs)),
        ]

    # ------------------------------------------------------------------ read API

    def initial_state(self) -> tuple[HardState, ConfState]:
        return self._hs, self._snap_meta.conf_state

    @property
    def hard_state(self) -> HardState:
        return self._hs

    def snapshot(self) -> Snapshot:
        if self._snap_data is None:
            assert self._snap_path is not None
            try:
                self._snap_data = snapfile.read_snapshot(self._snap_path).data
            except SnapshotCorruptionError as e:
                raise StorageCorruptionError(f"{self.path}: {e}") from e
        return Snapshot(self._snap_meta, self._snap_data)

    def release_snapshot_data(self) -> None:
        """Stop holding the current snapshot's image in memory (once it has been restored:
        at tens of millions of objects it is a gigabyte); :meth:`snapshot` reads it back
        from its file when a follower needs it."""
        if self._snap_path is not None:
            self._snap_data = None

    # ------------------------------------------------------------------ write API

    @property
    def wal(self) -> Wal:
        if self._wal is None:
            raise StorageError(f"storage {self.path} is closed")
        return self._wal

    def set_hard_state(self, hs: HardState) -> None:
        """Write the hard state (durable at the next :meth:`sync`)."""
        self.wal.append([_enc.encode(_WHardState(hs))])
        self._hs = hs

    def append(self, entries: list[Entry]) -> None:
        """Write entries; an entry at index i replaces the log from i on (durable at the next
        :meth:`sync`). Entries already covered by the snapshot/compaction are skipped."""
        entries = self._new_suffix(entries)
        if not entries:
            return
        seq = self.wal.append([_enc.encode(_WEntries(entries))])
        self._seg_max[seq] = max(self._seg_max.get(seq, 0), entries[-1].index)
        self._splice(entries)

    def sync(self) -> None:
        """One fdatasync covering everything written so far (group commit)."""
        self.wal.sync()

    # write(rd, staged) is ReadyWriter's (the one Ready write path of every storage).

    def stage_snapshot(self, snap: Snapshot) -> str:
        """Durably write a received snapshot's file (any thread); ``write`` then adds the WAL
        marker that makes it the log's base."""
        return snapfile.write_snapshot(self.snap_dir, snap)

    def stage_local_snapshot(self, meta: SnapshotMeta, parts: list[bytes]) -> str:
        """Durably write a local snapshot's file from the image's pieces (any thread; no
        big join under the GIL)."""
        return snapfile.write_snapshot(self.snap_dir, Snapshot(meta), 1 << 20, parts)

    def begin_local_snapshot(self, meta: SnapshotMeta) -> snapfile.SnapshotWriter:
        """A local snapshot's file, written piece by piece as the image is encoded (blocking
        calls: any thread); ``finish()`` returns what :meth:`commit_local_snapshot` takes."""
        return snapfile.SnapshotWriter(self.snap_dir, meta)

    def commit_local_snapshot(self, meta: SnapshotMeta, staged: Any) -> bool:
        """:meth:`commit_snapshot` without keeping the image in memory (it is read back from
        the file only if a follower needs it)."""
        self.commit_snapshot(Snapshot(meta), staged, keep_data=False)
        return self._snap_meta.index == meta.index

    def remove_snapshot_files(self, paths: list[str]) -> None:
        remove_files(self.snap_dir, paths)

    def persist(self, rd: Ready) -> None:
        """:meth:`write` plus at most one WAL fsync (group commit)."""
        if self.write(rd):
            self.sync()

    def apply_snapshot(self, snap: Snapshot, path: str | None = None) -> None:
        """Install a snapshot received from the leader: the durable file first (``path`` if
        the caller already wrote it with :func:`snapfile.write_snapshot`, e.g. in a worker
        thread), then a WAL marker (durable at the next :meth:`sync`), then the in-memory
        log is replaced. A crash before the marker is synced is handled by recovery: the
        newer snapshot file supersedes the log."""
        m = snap.meta
        if m.index < self._snap_meta.index:
            raise StorageError(
                f"snapshot at {m.index} is older than the stored one at {self._snap_meta.index}"
            )
        if path is None:
            path = snapfile.write_snapshot(self.snap_dir, snap)
        self.wal.append([_enc.encode(_WInstalled(m.index, m.term))])
        self._snap_meta, self._snap_data, self._snap_path = m, snap.data, path
        self._reset_log(m.index, m.term)
        if self._hs.commit < m.index:
            self._hs = HardState(self._hs.term, self._hs.vote, m.index)
        self._prune_snapshot_files()

    def prepare_snapshot(
        self, index: int, conf_state: ConfState, data: bytes
    ) -> tuple[Snapshot, str]:
        """Build and durably write a local snapshot at ``index`` (already applied). Only
        reads the immutable log, so it may run in a worker thread while the loop continues;
        finish with :meth:`commit_snapshot` on the owning thread."""
        if index <= self._snap_meta.index:
            raise StorageError(
                f"snapshot at {index} is not newer than the stored one at {self._snap_meta.index}"
            )
        if index > self.last_index():
            raise LogUnavailable(
                f"snapshot index {index} is beyond the last index {self.last_index()}"
            )
        snap = Snapshot(
            SnapshotMeta(index=index, term=self.term(index), conf_state=conf_state), data
        )
        return snap, snapfile.write_snapshot(self.snap_dir, snap)

    def commit_snapshot(self, snap: Snapshot, path: str, keep_data: bool = True) -> None:
        """Make a prepared snapshot the current one (a newer one may have been installed
        meanwhile: then this one is discarded). With ``keep_data=False`` the image is not
        held in memory; :meth:`snapshot` reads the file when a follower needs it."""
        if snap.meta.index <= self._snap_meta.index:
            if path != self._snap_path and os.path.exists(path):
                os.unlink(path)
            return
        self._snap_meta, self._snap_path = snap.meta, path
        self._snap_data = snap.data if keep_data else None
        self._prune_snapshot_files()

    def create_snapshot(self, index: int, conf_state: ConfState, data: bytes) -> Snapshot:
        """:meth:`prepare_snapshot` + :meth:`commit_snapshot` in one call."""
        snap, path = self.prepare_snapshot(index, conf_state, data)
        self.commit_snapshot(snap, path)
        return snap

    def obsolete_snapshot_files(self) -> list[str]:
        """Snapshot files that may be deleted: all but the newest ``keep_snapshots`` at or
        below the current snapshot. Files above it are never listed: they may belong to a
        snapshot being written right now (an install or a local snapshot in a thread)."""
        cur = self._snap_meta.index
        older = [f.path for f in snapfile.list_snapshots(self.snap_dir) if f.index <= cur]
        keep = set(older[-self.keep_snapshots :])
        if self._snap_path:
            keep.add(self._snap_path)
        return [p for p in older if p not in keep]

    def _prune_snapshot_files(self) -> None:
        if self.defer_pruning:
            return
        remove_files(self.snap_dir, self.obsolete_snapshot_files())

    def compact(self, index: int) -> None:
        """Discard entries up to ``index`` (at most the current snapshot's index) from memory
        and delete WAL segments holding nothing above it."""
        finish = self.compact_detached(index)
        if finish is not None:
            finish()

    def compact_detached(self, index: int) -> Callable[[], None] | None:
        """:meth:`compact`'s memory part now; its file part (unlinks and a directory fsync,
        tens of ms after a big snapshot) returned as a call for a worker thread, or None.
        No WAL sync is needed: the surviving segments are durable already
        (:meth:`Wal.detach_segments_before`)."""
        if index <= self.first_index() - 1:
            return None
        if index > self._snap_meta.index:
            raise StorageError(
                f"cannot compact to {index}: the newest snapshot is at {self._snap_meta.index}"
            )
        self._compact_log(index)
        wal = self.wal
        # Whole segments, oldest first, up to the first one holding an entry above index;
        # never the active one. The first kept segment's preamble makes it self-contained.
        cut = 0
        for seg in wal.segments[:-1]:
            if self._seg_max.get(seg.seq, 0) > index:
                break
            cut = seg.seq + 1
        if not cut:
            return None
        doomed = wal.detach_segments_before(cut)
        gone = {d.seq for d in doomed}
        for seq in [q for q in self._seg_max if q in gone]:
            del self._seg_max[seq]
        if not doomed:
            return None
        return functools.partial(wal.unlink_segments, doomed)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Sync and release the directory. Idempotent."""
        try:
            if self._wal is not None:
                self._wal.close()
        finally:
            self._wal = None
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1
