"""Checksummed, segmented write-ahead log of opaque records.

Disk format. A WAL directory holds segment files ``{seq:016x}.wal``. Each segment starts
with a 16-byte header (``b"KVMWAL01"`` + u64 little-endian segment sequence number),
followed by records framed as ``[len u32 LE][crc32c(payload) u32 LE][payload]``.

This module only frames bytes: what a record means (entries, hard state, snapshot
markers) is the business of :mod:`kvmesh.replog.storage.disk`.

Durability rules implemented here:

* group commit: :meth:`Wal.append` only writes; one :meth:`Wal.sync` (one ``fdatasync``,
  plus a directory fsync if a segment was created) makes everything appended so far
  durable;
* a failed write or fsync is fatal (:class:`WalFatalError`): the page cache state after
  a failed fsync is unknowable, so the WAL refuses every later call and the node must
  stop and recover from disk and peers;
* recovery (:meth:`Wal.open`) truncates a torn tail of the *last* segment (a suffix that
  was never fsynced, hence never acknowledged) and fails stop with
  :class:`WalCorruptionError` on a bad record anywhere else: it never replays a corrupt
  record and never silently skips one.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import crc32c

from ..errors import WalCorruptionError, WalError, WalFatalError

__all__ = [
    "WalError",
    "WalCorruptionError",
    "WalFatalError",
    "Wal",
    "WalSegment",
    "frame",
    "fsync_dir",
    "MAX_RECORD_BYTES",
]

_MAGIC = b"KVMWAL01"
_SEG_HEADER = struct.Struct("<8sQ")
_REC_HEADER = struct.Struct("<II")
HEADER_BYTES = _SEG_HEADER.size
MAX_RECORD_BYTES = 1 << 30
_SUFFIX = ".wal"


def frame(payload: bytes) -> bytes:
    """``[len][crc32c][payload]`` for one record."""
    return _REC_HEADER.pack(len(payload), crc32c.crc32c(payload)) + payload


def fsync_dir(path: str) -> None:
    """Make a directory's entries (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class WalSegment:
    """One segment file: its sequence number, path and size on disk (after recovery)."""

    seq: int
    path: str
    size: int


def _seg_name(seq: int) -> str:
    return f"{seq:016x}{_SUFFIX}"


def _parse_records(buf: bytes | memoryview, start: int) -> tuple[list[bytes], int, str | None]:
    """Records from ``start``; returns (payloads, end of the last good record, problem)."""
    out = []
    pos = start
    n = len(buf)
    unpack = _REC_HEADER.unpack_from
    crc = crc32c.crc32c
    while pos < n:
        if n - pos < _REC_HEADER.size:
            return out, pos, f"partial record header at offset {pos}"
        length, want = unpack(buf, pos)
        if length == 0 or length > MAX_RECORD_BYTES:
            return out, pos, f"implausible record length {length} at offset {pos}"
        if pos + 8 + length > n:
            return out, pos, f"record at offset {pos} runs past end of file ({length} bytes)"
        payload = bytes(buf[pos + 8 : pos + 8 + length])
        if crc(payload) != want:
            return out, pos, f"CRC mismatch in record at offset {pos} ({length} bytes)"
        out.append(payload)
        pos += 8 + length
    return out, pos, None


def _valid_record_after(buf: bytes, start: int) -> int | None:
    """Offset of any well-formed record strictly after ``start``, or None.

    Used to tell a torn tail (garbage/zeros up to EOF) from corruption in the middle (valid
    records follow the bad one)."""
    n = len(buf)
    crc = crc32c.crc32c
    unpack = _REC_HEADER.unpack_from
    # Fast path: a bit flip inside a payload leaves the length intact, so the next
    # record sits where the bad one says it ends.
    if n - start >= _REC_HEADER.size:
        length, _ = unpack(buf, start)
        nxt = start + 8 + length
        if length > 0 and nxt + _REC_HEADER.size <= n:
            l2, want = unpack(buf, nxt)
            if l2 > 0 and nxt + 8 + l2 <= n and crc(buf[nxt + 8 : nxt + 8 + l2]) == want:
                return nxt
    for pos in range(start + 1, n - _REC_HEADER.size):
        length, want = unpack(buf, pos)
        if length == 0 or pos + 8 + length > n:
            continue
        if crc(buf[pos + 8 : pos + 8 + length]) == want:
            return pos
    return None


class Wal:
    """An append-only, segmented, checksummed log. Not thread-safe; one writer. Appended
    records reach the file at the next :meth:`sync` (which may run in a worker thread while
    the writer does not append).

    Open with :meth:`open`, which recovers and exposes the surviving records through
    :meth:`replay`. ``preamble`` is called whenever a new segment is started and returns
    records written first into it (the storage layer repeats its hard state and snapshot
    marker there, so that deleting older segments never loses them).
    """

    def __init__(
        self, dirpath: str, segment_bytes: int, preamble: Callable[[], Sequence[bytes]] | None
    ) -> None:
        self.dir = dirpath
        self.segment_bytes = segment_bytes
        self.preamble = preamble
        self._segments: list[WalSegment] = []
        self._fd = -1
        self._dir_dirty = False
        self._unsynced = False
        self._pending: list[bytes] = []  # records appended, written by the next sync
        self._plock = threading.Lock()  # held only to hand _pending over, never during I/O
        # Whether the active segment's header and preamble are known durable (a sync since
        # it was created): until then deleting older segments must keep a closed one.
        self._active_durable = False
        self._failed: str | None = None
        self._replay: list[tuple[int, bytes]] = []
        self.truncated_bytes = 0  # torn tail removed during recovery (for logs/tests)
        self.fsyncs = 0

    # ------------------------------------------------------------------ open / recovery

    @classmethod
    def open(
        cls,
        dirpath: str,
        segment_bytes: int = 64 << 20,
        preamble: Callable[[], Sequence[bytes]] | None = None,
    ) -> Wal:
        """Open (creating if needed) and recover the WAL in ``dirpath``.

        Raises :class:`WalCorruptionError` if a record other than a torn tail is bad.
        """
        os.makedirs(dirpath, exist_ok=True)
        wal = cls(dirpath, segment_bytes, preamble)
        wal._recover()
        return wal

    def _list(self) -> list[tuple[int, str]]:
        segs = []
        for name in os.listdir(self.dir):
            if not name.endswith(_SUFFIX):
                continue
            stem = name[: -len(_SUFFIX)]
            try:
                seq = int(stem, 16)
            except ValueError:
                raise WalCorruptionError(
                    f"unexpected file in WAL directory {self.dir}: {name}"
                ) from None
            segs.append((seq, os.path.join(self.dir, name)))
        segs.sort()
        return segs

    def _recover(self) -> None:
        segs = self._list()
        for k, (seq, path) in enumerate(segs):
            last = k == len(segs) - 1
            if k and seq != segs[k - 1][0] + 1:
                raise WalCorruptionError(
                    f"WAL segment gap in {self.dir}: segment {segs[k - 1][0]:#x} "
                    f"is followed by {seq:#x}"
                )
            with open(path, "rb") as f:
                buf = f.read()
            if len(buf) < HEADER_BYTES:
                if not last:
                    raise WalCorruptionError(f"WAL segment {path} is truncated inside its header")
                # Crash while creating the newest segment: nothing in it was ever synced.
                self._rewrite_header(path, seq)
                self.truncated_bytes += len(buf)
                buf = _SEG_HEADER.pack(_MAGIC, seq)
            magic, hseq = _SEG_HEADER.unpack_from(buf, 0)
            if magic != _MAGIC or hseq != seq:
                raise WalCorruptionError(
                    f"WAL segment {path} has a bad header (magic {magic!r}, seq {hseq:#x})"
                )
            records, end, problem = _parse_records(buf, HEADER_BYTES)
            if problem is not None:
                if not last:
                    raise WalCorruptionError(
                        f"WAL segment {path}: {problem} (not the last segment)"
                    )
                later = _valid_record_after(buf, end)
                if later is not None:
                    raise WalCorruptionError(
                        f"WAL segment {path}: {problem}, "
                        f"but a valid record follows at offset {later}: "
                        "corruption in the middle of the log, refusing to start"
                    )
                self._truncate(path, end)
                self.truncated_bytes += len(buf) - end
            self._segments.append(WalSegment(seq, path, end))
            self._replay.extend((seq, r) for r in records)
            if last and not records:
                # The newest segment lost even its preamble: nothing in it was ever synced
                # (rotation and compaction sync first). Drop it, so that every segment we
                # append to starts with a preamble.
                os.unlink(path)
                fsync_dir(self.dir)
                self._segments.pop()
                if not self._segments:
                    self._start_segment(seq)
                    return
        if self._segments:
            seg = self._segments[-1]
            self._fd = os.open(seg.path, os.O_WRONLY | os.O_APPEND)
        else:
            self._start_segment(1)

    def _rewrite_header(self, path: str, seq: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, _SEG_HEADER.pack(_MAGIC, seq))
            os.fsync(fd)
        finally:
            os.close(fd)

    def _truncate(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)

    def replay(self) -> Iterator[tuple[int, bytes]]:
        """(segment seq, payload) of every record that survived recovery, in order.

        Available once, right after :meth:`open` (the buffer is released afterwards)."""
        recs, self._replay = self._replay, []
        return iter(recs)

    # ------------------------------------------------------------------ writing

    def _check(self) -> None:
        if self._failed is not None:
            raise WalFatalError(
                f"WAL in {self.dir} failed earlier ({self._failed}); restart the node"
            )

    def _fail(self, what: str, exc: BaseException) -> WalFatalError:
        self._failed = f"{what}: {exc}"
        return WalFatalError(f"WAL {what} failed in {self.dir}: {exc}")

    def _start_segment(self, seq: int) -> None:
        path = os.path.join(self.dir, _seg_name(seq))
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            os.write(fd, _SEG_HEADER.pack(_MAGIC, seq))
        except OSError as e:
            raise self._fail("segment creation", e) from e
        self._fd = fd
        self._segments.append(WalSegment(seq, path, HEADER_BYTES))
        self._dir_dirty = True
        self._unsynced = True
        self._active_durable = False
        if self.preamble is not None:
            pre = list(self.preamble())
            if pre:
                self._write(pre)

    def rotate(self) -> None:
        """Close the active segment (durably) and start a new one."""
        self._check()
        self.sync()
        try:
            os.close(self._fd)
        except OSError as e:
            raise self._fail("close", e) from e
        self._start_segment(self._segments[-1].seq + 1)

    def _write(self, payloads: Sequence[bytes]) -> None:
        hdr = _REC_HEADER.pack
        crc = crc32c.crc32c
        parts = []
        for p in payloads:
            if not p:
                raise ValueError("WAL records must not be empty")
            if len(p) > MAX_RECORD_BYTES:
                raise ValueError(
                    f"WAL record of {len(p)} bytes exceeds the {MAX_RECORD_BYTES}-byte limit"
                )
            parts.append(hdr(len(p), crc(p)))
            parts.append(p)
        # Written by the next sync, in its worker thread: a write(2) into the page cache can
        # block for tens of ms under dirty-page writeback (a snapshot file being written),
        # and the event loop that appends must not (docs/store-master.md, "Event-loop
        # stalls"). Unsynced records were never promised to survive a crash.
        buf = b"".join(parts)
        with self._plock:
            self._pending.append(buf)
        self._segments[-1].size += sum(len(p) + 8 for p in payloads)
        self._unsynced = True

    def _flush(self) -> None:
        """Write the records :meth:`_write` kept, in order (the caller syncs)."""
        with self._plock:
            bufs, self._pending = self._pending, []
        try:
            for b in bufs:
                buf = memoryview(b)
                while buf:
                    n = os.write(self._fd, buf)
                    buf = buf[n:]
        except OSError as e:
            raise self._fail("write", e) from e

    def append(self, payloads: Sequence[bytes]) -> int:
        """Write records (not yet durable: call :meth:`sync`). Returns the segment seq
        they landed in; a batch is never split across segments."""
        self._check()
        if not payloads:
            return self._segments[-1].seq
        if self._segments[-1].size >= self.segment_bytes:
            self.rotate()
        self._write(payloads)
        return self._segments[-1].seq

    def sync(self) -> None:
        """One fdatasync for everything appended since the last sync (group commit)."""
        self._check()
        if not self._unsynced:
            return
        self._flush()
        try:
            os.fdatasync(self._fd)
            if self._dir_dirty:
                fsync_dir(self.dir)
                self._dir_dirty = False
        except OSError as e:
            raise self._fail("fsync", e) from e
        with self._plock:  # an append racing this sync is written by the next one
            self._unsynced = bool(self._pending)
        self._active_durable = True  # read on the loop while this runs in a worker: late is safe
        self.fsyncs += 1

    # ------------------------------------------------------------------ compaction

    @property
    def segments(self) -> list[WalSegment]:
        return list(self._segments)

    @property
    def active_seq(self) -> int:
        return self._segments[-1].seq

    def remove_segments_before(self, seq: int) -> int:
        """Delete whole segments with sequence number < ``seq`` (never the active one).
        Returns how many were removed. Durable before returning."""
        self._check()
        # The survivors must be durable before their predecessors go: the oldest survivor's
        # preamble is what recovery will start from (forced: a reopened active segment's
        # bytes may be in the page cache only).
        self._unsynced = True
        self.sync()
        doomed = self.detach_segments_before(seq)
        self.unlink_segments(doomed)
        return len(doomed)

    def detach_segments_before(self, seq: int) -> list[WalSegment]:
        """Forget whole segments with sequence number < ``seq`` without touching a file or
        syncing (cheap: on the event loop); :meth:`unlink_segments` then deletes them, in any
        thread. The oldest survivor must be durable (recovery starts from its preamble):
        closed segments are (:meth:`rotate` syncs before closing); the active one only after
        a sync since it was created, so until then the newest closed segment is kept."""
        self._check()
        seq = min(seq, self.active_seq)
        if seq == self.active_seq and not self._active_durable:
            seq -= 1
        doomed = [s for s in self._segments if s.seq < seq]
        if doomed:
            self._segments = [s for s in self._segments if s.seq >= seq]
        return doomed

    def unlink_segments(self, doomed: list[WalSegment]) -> None:
        """Delete detached segments, oldest first (a crash midway leaves a contiguous suffix),
        and make it durable. Touches only the file system: safe in a worker thread while
        the owner appends and syncs."""
        if not doomed:
            return
        try:
            for s in doomed:
                os.unlink(s.path)
            fsync_dir(self.dir)
        except OSError as e:
            raise self._fail("segment removal", e) from e

    def close(self) -> None:
        """Sync (unless failed) and close. Idempotent."""
        if self._fd < 0:
            return
        try:
            if self._failed is None:
                self.sync()
        finally:
            os.close(self._fd)
            self._fd = -1
