"""Disk segments: a file (or a directory of files) on a local filesystem, published as a segment.

A node contributes disk the way it contributes memory: ``TransferEngine.register_disk(path,
size, name=...)`` opens (or creates) the file, reserves its space and publishes it; peers read
and write it by offset like any segment. The engine still knows nothing about keys.

* **Same process** (the ``disk`` transport, ``transports/disk.py``): ``preadv``/``pwritev``
  straight between the file and the caller's registered memory. Where the filesystem takes
  ``O_DIRECT`` (ext4, xfs: not tmpfs) the file-aligned middle of each range goes through an
  ``O_DIRECT`` descriptor, so bulk bytes skip the page cache; the unaligned head and tail of a
  range go through an ordinary descriptor of the same file, whose page cache merges partial
  blocks under the kernel's page lock. A read-modify-write of a shared block through a
  staging buffer would race with a neighbouring range written at the same time (two store
  objects may share a 4 KiB block); the page cache does not. Memory that is not aligned
  like the file (``(address - file offset) % 4096 != 0``) is bounced through an aligned
  staging buffer, ``O_DIRECT`` still. The kernel keeps the two descriptors coherent
  (``O_DIRECT`` I/O writes back and invalidates cached pages of its range).
* **Peers** (any other process, same host or not) go through the owner: the TCP path's
  owner half (``transports/tcp.py``) hands requests on a disk segment to
  :meth:`DiskSegment.serve_write` / :meth:`DiskSegment.serve_read`, which move the payload
  through staging buffers. The descriptor names no path: a peer cannot make the owner open
  a file, only offsets inside the one it registered, checked by ``ranges.check_ranges``
  like every request.
* **Durability.** An acknowledged write is in the page cache or on the device, not durable.
  :meth:`DiskSegment.sync` (``TransferEngine.sync_segment``, locally or through the owner)
  runs ``fdatasync`` on every file; a segment registered with ``durable=True`` does that
  before every write is acknowledged. :func:`checksums` / :func:`verify` (crc32c) are what
  the store records per replica and checks after a read; :meth:`DiskSegment.checksums`
  (``TransferEngine.checksum_segment``) computes them where the bytes are, without moving
  them.
* **Lifetime.** A disk segment is a :class:`~kvmesh.transfer.memory.Users`, like a memory
  region: jobs hold it, ``unregister`` refuses new ones and waits for the running ones, and
  the TCP owner half cuts stalled peers (``ControlServer.end_users_of``). An existing file
  is opened as it is (nothing is wiped: a restarted node re-adopts what it wrote); one
  process at a time holds it (an OFD lock on byte 0).
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import itertools
import mmap
import os
import stat
import threading
from collections.abc import Callable
from typing import Annotated, Any, Literal

import crc32c
import msgspec
import numpy as np

from . import shmfile
from .errors import (
    ChecksumMismatch,
    DiskIOError,
    InvalidArgument,
    InvalidLength,
    NotRegistered,
    RequestTooLarge,
    SegmentNotFound,
    TransferError,
)
from .memory import Users
from .ranges import check_ranges
from .sockio import drain, recv_into_views, send_views
from .transports.base import CHUNK_BYTES, chunks, cut
from .types import EngineConfig, Op

__all__ = [
    "ALIGN",
    "ChecksumMismatch",
    "DiskSegment",
    "checksum",
    "checksums",
    "find_live",
    "open_disk",
    "verify",
]

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and memory (a 4Kn device's block)
STAGE_BYTES = 4 << 20  # one staging buffer (bounced ranges, the owner's TCP path)
FILE_BYTES = 1 << 30  # size of each file of a directory segment
_KEEP_STAGES = 8  # idle staging buffers kept per segment
DEPTH = 4  # requests one call keeps in flight on the device (register_disk(depth=...))
DEPTH_MIN_BYTES = 2 << 20  # smaller calls run in the calling thread alone
_IO_THREADS = 16  # the process's disk I/O threads (idle ones block: no CPU)
_AHEAD_THREADS = 8  # TCP requests on disk segments whose next part moves during this one's
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_U64 = np.dtype("<u8")


# --- checksums ------------------------------------------------------------------------------


def checksum(data: Any, value: int = 0) -> int:
    """crc32c of a buffer (continuing from ``value``)."""
    return crc32c.crc32c(data, value)


def checksums(buf: np.ndarray, offsets: Any, lengths: Any) -> np.ndarray:
    """crc32c of each range ``buf[offsets[i] : offsets[i] + lengths[i]]`` (``uint32`` array).

    ``buf`` is a ``uint8`` array (``MemoryRegion.array()``); ranges are bounds-checked.
    """
    offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    check_ranges("checksum", lens, (offs, len(buf), "buffer"))
    out = np.empty(len(lens), np.uint32)
    for i, (o, n) in enumerate(zip(offs.tolist(), lens.tolist())):
        out[i] = crc32c.crc32c(buf[o : o + n])
    return out


def verify(buf: np.ndarray, offsets: Any, lengths: Any, expected: Any) -> None:
    """Raise :class:`ChecksumMismatch` (``bad``: the ranges that differ) unless every range of
    ``buf`` has its ``expected`` crc32c."""
    want = np.asarray(expected, dtype=np.uint32).reshape(-1)
    got = checksums(buf, offsets, lengths)
    if len(want) != len(got):
        raise InvalidLength(f"{len(got)} ranges but {len(want)} checksums")
    bad = np.flatnonzero(got != want)
    if len(bad):
        i = int(bad[0])
        raise ChecksumMismatch(
            f"{len(bad)} of {len(got)} ranges fail their checksum (first: #{i}, "
            f"crc32c {int(got[i]):#010x}, recorded {int(want[i]):#010x})",
            bad,
        )


# --- the segment ----------------------------------------------------------------------------


class _File:
    __slots__ = ("path", "start", "size", "fd", "dfd")

    def __init__(self, path: str, start: int, size: int, fd: int, dfd: int) -> None:
        self.path = path
        self.start = start  # segment offset of the file's byte 0
        self.size = size
        self.fd = fd  # buffered descriptor: heads, tails, fdatasync, files without O_DIRECT
        self.dfd = dfd  # O_DIRECT descriptor, or -1


_live_lock = threading.Lock()
_live: dict[int, DiskSegment] = {}
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_ahead: concurrent.futures.ThreadPoolExecutor | None = None


def _io_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _live_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(_IO_THREADS, "kvmesh-disk")
        return _pool


def _ahead_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that read or write a TCP request's next part while the server's thread moves
    the current one through the socket. Not :func:`_io_pool`: their ``io`` calls queue runs
    there and wait for them, which could exhaust one shared pool and wait forever."""
    global _ahead
    with _live_lock:
        if _ahead is None:
            _ahead = concurrent.futures.ThreadPoolExecutor(_AHEAD_THREADS, "kvmesh-disk-ahead")
        return _ahead


def find_live(region_id: int) -> DiskSegment | None:
    """The registered disk segment of this process with this id, if any."""
    return _live.get(region_id)


class DiskSegment(Users):
    """A registered disk segment (see the module docstring). Made by :func:`open_disk`."""

    __slots__ = (
        "path",
        "size",
        "direct",
        "durable",
        "name",
        "seg_id",
        "depth",
        "_files",
        "_file_bytes",
        "_stages",
        "_stage_lock",
        "__weakref__",
    )

    def __init__(
        self,
        path: str,
        size: int,
        files: list[_File],
        file_bytes: int,
        durable: bool,
        depth: int = DEPTH,
    ) -> None:
        super().__init__()
        self.path = path
        self.size = size
        self.direct = all(f.dfd >= 0 for f in files)
        self.durable = durable
        self.name: str | None = None  # segment name once published
        self.seg_id = -1  # the published descriptor's seg_id
        self.depth = max(1, depth)
        self._files = files
        self._file_bytes = file_bytes
        self._stages: list[np.ndarray] = []
        self._stage_lock = threading.Lock()
        with _live_lock:
            _live[self.region_id] = self

    @property
    def is_host(self) -> bool:
        return True  # served through host memory (the TCP owner half asks)

    def _what(self) -> str:
        return f"disk segment {self.name or self.path!r}"

    def __repr__(self) -> str:
        mode = "O_DIRECT" if self.direct else "buffered"
        return (
            f"DiskSegment({self.path!r}, size={self.size}, files={len(self._files)}, {mode}"
            f"{', durable' if self.durable else ''})"
        )

    # --- staging buffers ------------------------------------------------------------------
    def _take_stage(self) -> np.ndarray:
        with self._stage_lock:
            if self._stages:
                return self._stages.pop()
        # Anonymous mappings are page aligned: what O_DIRECT needs.
        return np.frombuffer(mmap.mmap(-1, STAGE_BYTES), dtype=np.uint8)

    def _give_stage(self, stage: np.ndarray) -> None:
        with self._stage_lock:
            if len(self._stages) < _KEEP_STAGES:
                self._stages.append(stage)

    # --- byte movement --------------------------------------------------------------------
    def _split_files(
        self, lo: np.ndarray, fo: np.ndarray, ln: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The same ranges cut where one file of a directory segment ends and the next begins."""
        if len(self._files) == 1 or len(ln) == 0:
            return lo, fo, ln
        fb = np.uint64(self._file_bytes)
        first, last = fo // fb, (fo + ln - np.uint64(1)) // fb
        if (first == last).all():
            return lo, fo, ln
        pieces = (last - first + np.uint64(1)).astype(np.int64)
        src = np.repeat(np.arange(len(ln)), pieces)
        k = (np.arange(len(src)) - np.repeat(np.cumsum(pieces) - pieces, pieces)).astype(np.uint64)
        start = np.maximum(fo[src], (first[src] + k) * fb)
        end = np.minimum(fo[src] + ln[src], (first[src] + k + np.uint64(1)) * fb)
        return lo[src] + (start - fo[src]), start, end - start

    def io(
        self,
        op: Op,
        mem: np.ndarray,
        mem_offsets: np.ndarray,
        seg_offsets: np.ndarray,
        lengths: np.ndarray,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Move ranges between ``mem`` (a ``uint8`` array of host memory) and the segment:
        ``READ`` file -> memory, ``WRITE`` memory -> file. Ranges were checked by the caller
        (uint64 arrays); ``check`` runs between chunks of at most ``CHUNK_BYTES``."""
        lo, fo, ln = self._split_files(*cut(mem_offsets, seg_offsets, lengths, CHUNK_BYTES))
        depth = min(self.depth, len(ln))
        total = int(ln.sum()) if depth > 1 else 0
        if depth < 2 or total < DEPTH_MIN_BYTES:
            self._io_run(op, mem, lo, fo, ln, check)
            return
        # Several requests in flight keep a device's queues busy (NVMe, virtio: one thread
        # of 4 MiB preadv calls measured ~0.5x of four here, bench/tier.py): cut the ranges
        # into `depth` runs of about equal bytes, run all but the first on the I/O threads.
        edges = np.searchsorted(np.cumsum(ln), np.arange(1, depth) * (total // depth), "right")
        bounds = [0, *sorted({int(e) for e in edges if 0 < e < len(ln)}), len(ln)]
        runs = list(itertools.pairwise(bounds))
        futures = [
            _io_pool().submit(self._io_run, op, mem, lo[a:b], fo[a:b], ln[a:b], check)
            for a, b in runs[1:]
        ]
        try:
            a, b = runs[0]
            self._io_run(op, mem, lo[a:b], fo[a:b], ln[a:b], check)
        finally:
            errors = [f.exception() for f in futures]  # waits for every run
        for exc in errors:
            if exc is not None:
                raise exc

    def _io_run(
        self,
        op: Op,
        mem: np.ndarray,
        lo: np.ndarray,
        fo: np.ndarray,
        ln: np.ndarray,
        check: Callable[[], None] | None,
    ) -> None:
        write = op is Op.WRITE
        base = mem.ctypes.data
        fb = self._file_bytes
        files = self._files
        since = 0
        for m, o, n in zip(lo.tolist(), fo.tolist(), ln.tolist()):
            if check is not None and since >= CHUNK_BYTES:
                check()
                since = 0
            since += n
            f = files[o // fb] if len(files) > 1 else files[0]
            o -= f.start
            if f.dfd < 0:
                _pio(f.fd, mem[m : m + n], o, write, f.path)
                continue
            head = min(n, -o % ALIGN)
            mid = (n - head) // ALIGN * ALIGN
            if head:
                _pio(f.fd, mem[m : m + head], o, write, f.path)
            if mid:
                a, b = m + head, m + head + mid
                if (base + a) % ALIGN == 0:
                    _pio(f.dfd, mem[a:b], o + head, write, f.path)
                else:
                    self._bounce(f, mem[a:b], o + head, write)
            if head + mid < n:
                _pio(f.fd, mem[m + head + mid : m + n], o + head + mid, write, f.path)

    def _bounce(self, f: _File, view: np.ndarray, off: int, write: bool) -> None:
        """An aligned file range whose memory is not aligned: through a staging buffer."""
        stage = self._take_stage()
        try:
            for a in range(0, len(view), STAGE_BYTES):
                part = view[a : a + STAGE_BYTES]
                s = stage[: len(part)]
                if write:
                    s[:] = part
                    _pio(f.dfd, s, off + a, True, f.path)
                else:
                    _pio(f.dfd, s, off + a, False, f.path)
                    part[:] = s
        finally:
            self._give_stage(stage)

    def sync(self) -> None:
        """Make every write done so far durable (``fdatasync`` of each file)."""
        for f in self._files:
            try:
                os.fdatasync(f.fd)
            except OSError as exc:
                raise DiskIOError(f"fdatasync of {f.path!r} failed: {exc.strerror}") from None

    def checksums(self, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """crc32c of each range of the segment (``uint32``), read through staging buffers
        (ranges checked by the caller)."""
        out = np.empty(len(lengths), np.uint32)
        stage = self._take_stage()
        try:
            for i, (o, n) in enumerate(zip(offsets.tolist(), lengths.tolist())):
                crc = 0
                for a in range(0, n, STAGE_BYTES):
                    k = min(STAGE_BYTES, n - a)
                    one = np.array([k], np.uint64)
                    self.io(
                        Op.READ, stage, np.zeros(1, np.uint64), np.array([o + a], np.uint64), one
                    )
                    crc = crc32c.crc32c(stage[:k], crc)
                out[i] = crc
        finally:
            self._give_stage(stage)
        return out

    # --- the owner's half of the TCP path -------------------------------------------------
    def _part_io(self, op: Op, parts: list[Any], stages: list[np.ndarray], i: int) -> None:
        """Move part ``i`` of a request between the file and its staging buffer (of two)."""
        _, fo, ln = parts[i]
        self.io(op, stages[i % 2], np.cumsum(ln) - ln, fo, ln)

    def serve_write(
        self, sock: Any, offsets: np.ndarray, lengths: np.ndarray, deadline: Any
    ) -> TransferError | None:
        """Receive a WRITE's payload (the ranges in order) and write it to the file.

        Two staging buffers: part ``i + 1`` arrives from the socket while part ``i`` is
        written on a disk thread, so the peer sees about the slower of the two paths, not
        their sum. Returns the error to answer with when the file refused (the rest of the
        payload is drained, so the connection stays in step); socket errors raise.
        """
        parts = chunks(offsets, offsets, lengths, STAGE_BYTES // 2)
        stages = [self._take_stage() for _ in range(min(2, len(parts)))]
        behind: concurrent.futures.Future[None] | None = None  # the previous part's write

        write = functools.partial(self._part_io, Op.WRITE, parts, stages)

        def written(fut: concurrent.futures.Future[None]) -> TransferError | None:
            exc = fut.exception()
            if exc is not None and not isinstance(exc, TransferError):
                raise exc
            return exc

        failed: TransferError | None = None
        try:
            for i, (_, _, ln) in enumerate(parts):
                recv_into_views(sock, [memoryview(stages[i % 2])[: int(ln.sum())]], deadline)
                if behind is not None:
                    # part i + 1 goes into the stage part i - 1 is being written from
                    done, behind = behind, None
                    failed = written(done)
                    if failed is not None:
                        drain(sock, sum(int(p[2].sum()) for p in parts[i + 1 :]), deadline)
                        break
                if i + 1 == len(parts):
                    try:
                        write(i)
                    except TransferError as exc:
                        failed = exc
                else:
                    behind = _ahead_pool().submit(write, i)
        finally:
            if behind is not None:
                concurrent.futures.wait([behind])  # a stage is never reused mid-write
            for stage in stages:
                self._give_stage(stage)
        if failed is None and self.durable:
            try:
                self.sync()
            except TransferError as exc:
                failed = exc
        return failed

    def serve_read(
        self, sock: Any, offsets: np.ndarray, lengths: np.ndarray, head: bytes, deadline: Any
    ) -> TransferError | None:
        """Read the ranges and push them after ``head`` (the ``ReadResp``).

        Two staging buffers: part ``i + 1`` is read on a disk thread while part ``i`` is
        sent. The first part is read before ``head`` is sent: a file that refuses it returns
        the error to answer with instead; a later failure raises (the connection is closed).
        """
        parts = chunks(offsets, offsets, lengths, STAGE_BYTES // 2)
        stages = [self._take_stage() for _ in range(min(2, len(parts)))]
        ahead: concurrent.futures.Future[None] | None = None  # the next part's read

        read = functools.partial(self._part_io, Op.READ, parts, stages)

        try:
            try:
                read(0)
            except TransferError as exc:
                return exc
            for i, (_, _, ln) in enumerate(parts):
                if i + 1 < len(parts):
                    ahead = _ahead_pool().submit(read, i + 1)
                views = [memoryview(stages[i % 2])[: int(ln.sum())]]
                if i == 0:
                    views.insert(0, memoryview(head))
                send_views(sock, views, deadline)
                if ahead is not None:
                    done, ahead = ahead, None
                    done.result()  # a failure after the head raises: the connection closes
        finally:
            if ahead is not None:
                concurrent.futures.wait([ahead])  # a stage is never reused mid-read
            for stage in stages:
                self._give_stage(stage)
        return None

    def close(self, timeout: float) -> None:
        """Refuse new jobs, wait (bounded) for the running ones, close the files."""
        self.wait_unused(timeout)
        with _live_lock:
            _live.pop(self.region_id, None)
        for f in self._files:
            for fd in (f.dfd, f.fd):
                if fd >= 0:
                    os.close(fd)
            f.fd = f.dfd = -1


def _pio(fd: int, view: np.ndarray, off: int, write: bool, path: str) -> None:
    """``pwritev``/``preadv`` of the whole ``view`` at ``off`` (short transfers resumed)."""
    done, n = 0, len(view)
    while done < n:
        part = view[done:] if done else view
        try:
            got = os.pwritev(fd, [part], off + done) if write else os.preadv(fd, [part], off + done)
        except InterruptedError:
            continue
        except OSError as exc:
            what = "write" if write else "read"
            raise DiskIOError(
                f"{what} of {n - done} bytes at {off + done} of {path!r} failed: {exc.strerror}"
            ) from None
        if got <= 0:
            raise DiskIOError(f"short {'write' if write else 'read'} at {off + done} of {path!r}")
        done += got


# --- opening --------------------------------------------------------------------------------


def _layout(path: str, size: int, file_bytes: int | None) -> tuple[list[tuple[str, int]], int]:
    """``[(file path, file size)]`` and the size of each file but the last."""
    if os.path.isdir(path):
        fb = FILE_BYTES if file_bytes is None else int(file_bytes)
        if fb <= 0 or fb % ALIGN:
            raise InvalidArgument(f"file_bytes must be a positive multiple of {ALIGN}, got {fb}")
        n = -(-size // fb)
        return [
            (os.path.join(path, f"kvmesh-disk-{i:05d}.seg"), min(fb, size - i * fb))
            for i in range(n)
        ], fb
    return [(path, size)], size


def _free_bytes(path: str) -> int:
    st = os.statvfs(os.path.dirname(os.path.abspath(path)) if not os.path.isdir(path) else path)
    return st.f_bavail * st.f_frsize


def open_disk(
    path: str | os.PathLike[str],
    size: int,
    *,
    direct: bool | None = None,
    durable: bool = False,
    file_bytes: int | None = None,
    depth: int = DEPTH,
) -> DiskSegment:
    """Open (or create) the disk segment at ``path``: a file, or an existing directory that
    gets files of ``file_bytes`` (default 1 GiB). Existing bytes are kept.

    ``direct``: ``None`` uses ``O_DIRECT`` where the filesystem takes it, ``True`` requires
    it, ``False`` never. ``durable``: every write is ``fdatasync``-ed before it is
    acknowledged. ``depth``: requests one call keeps in flight on the device. Raises
    ``InvalidArgument`` with the reason when the path is not writable,
    not a regular file, in use by another process, or its filesystem lacks the space.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise InvalidLength(f"disk segment size must be a positive integer, got {size!r}")
    path = os.fspath(path)
    if not path:
        raise InvalidArgument("disk path must be non-empty")
    layout, fb = _layout(path, size, file_bytes)
    need = 0
    for p, want in layout:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            need += want
        except OSError as exc:
            raise InvalidArgument(f"disk path {p!r} is not usable: {exc.strerror}") from None
        else:
            need += max(0, want - st.st_blocks * 512)
    try:
        free = _free_bytes(path)
    except OSError as exc:
        raise InvalidArgument(f"disk path {path!r} is not usable: {exc.strerror}") from None
    if need > free:
        raise InvalidArgument(
            f"disk path {path!r}: its filesystem has {free} bytes free but the segment of "
            f"{size} bytes needs {need} more"
        )
    files: list[_File] = []
    try:
        start = 0
        for p, want in layout:
            files.append(_open_file(p, start, want, direct))
            start += want
    except BaseException:
        for f in files:
            for fd in (f.dfd, f.fd):
                if fd >= 0:
                    os.close(fd)
        raise
    return DiskSegment(path, size, files, fb, durable, depth)


def _open_file(p: str, start: int, want: int, direct: bool | None) -> _File:
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise InvalidArgument(f"disk path {p!r} is not writable: {exc.strerror}") from None
    dfd = -1
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"disk path {p!r} is not a regular file")
        if not shmfile.try_lock(fd, 0, write=True):
            raise InvalidArgument(f"disk path {p!r} is in use by another process")
        if st.st_size < want:
            try:
                os.posix_fallocate(fd, 0, want)  # reserve the space now: no ENOSPC later
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise InvalidArgument(
                        f"disk path {p!r}: no space for {want} bytes on its filesystem"
                    ) from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise InvalidArgument(f"disk path {p!r}: {exc.strerror}") from None
                os.ftruncate(fd, want)
        if direct is not False:
            dfd = _open_direct(p)
            if dfd < 0 and direct:
                raise InvalidArgument(f"disk path {p!r}: its filesystem refuses O_DIRECT")
        return _File(p, start, want, fd, dfd)
    except BaseException:
        os.close(fd)
        raise


def _open_direct(p: str) -> int:
    """An ``O_DIRECT`` descriptor of ``p`` that passed one aligned read, or -1."""
    if not _O_DIRECT:
        return -1
    try:
        dfd = os.open(p, os.O_RDWR | os.O_CLOEXEC | _O_DIRECT)
    except OSError:
        return -1  # EINVAL on tmpfs and the like
    probe = np.frombuffer(mmap.mmap(-1, ALIGN), dtype=np.uint8)
    try:
        os.preadv(dfd, [probe], 0)
    except OSError:
        os.close(dfd)
        return -1
    return dfd


# --- peer calls: sync and checksums through the owner ----------------------------------------

_Bytes = Annotated[bytes, msgspec.Meta(max_length=16 << 20)]


class DiskCall(msgspec.Struct, frozen=True):
    """A peer asks the owner of a disk segment to sync it or checksum ranges of it."""

    op: Literal["sync", "checksum"]
    region_id: Annotated[int, msgspec.Meta(ge=0)]
    seg_id: Annotated[int, msgspec.Meta(ge=0)]
    offsets: _Bytes = b""  # little-endian uint64 arrays (checksum)
    lengths: _Bytes = b""


class DiskReply(msgspec.Struct, frozen=True):
    crcs: bytes = b""  # little-endian uint32 array


_call_decoder = msgspec.msgpack.Decoder(DiskCall)
_reply_decoder = msgspec.msgpack.Decoder(DiskReply)


def encode_call(call: DiskCall) -> bytes:
    return msgspec.msgpack.encode(call)


def decode_reply(payload: bytes, n: int) -> np.ndarray:
    try:
        crcs = np.frombuffer(_reply_decoder.decode(payload).crcs, "<u4")
    except (msgspec.DecodeError, ValueError) as exc:
        from .errors import ProtocolError

        raise ProtocolError(f"bad disk call reply: {exc}") from None
    if len(crcs) != n:
        from .errors import ProtocolError

        raise ProtocolError(f"disk call answered {len(crcs)} checksums for {n} ranges")
    return crcs.astype(np.uint32)


def handle_call(payload: bytes, config: EngineConfig) -> bytes:
    """The owner's answer to a :class:`DiskCall` (every field checked before any I/O)."""
    try:
        call = _call_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"bad disk call: {str(exc)[:200]}") from None
    seg = _live.get(call.region_id)
    if seg is None or seg.seg_id != call.seg_id:
        raise SegmentNotFound("no such disk segment here (removed or replaced)")
    if call.op == "sync":
        with _held(seg):
            seg.sync()
        return msgspec.msgpack.encode(DiskReply())
    if len(call.offsets) % 8 or len(call.offsets) != len(call.lengths):
        raise InvalidLength("offsets and lengths must be packed uint64 arrays of one count")
    offs, lens = np.frombuffer(call.offsets, _U64), np.frombuffer(call.lengths, _U64)
    if len(lens) > config.max_request_pieces:
        raise RequestTooLarge(f"{len(lens)} ranges exceed the limit of {config.max_request_pieces}")
    total = check_ranges(f"checksum on segment {seg.name!r}", lens, (offs, seg.size, "it"))
    if total > config.max_request_bytes:
        raise RequestTooLarge(f"{total} bytes exceed the limit of {config.max_request_bytes}")
    with _held(seg):
        crcs = seg.checksums(offs, lens)
    return msgspec.msgpack.encode(DiskReply(crcs.astype("<u4").tobytes()))


class _held:
    __slots__ = ("seg",)

    def __init__(self, seg: DiskSegment) -> None:
        self.seg = seg

    def __enter__(self) -> DiskSegment:
        try:
            self.seg.acquire()
        except NotRegistered:
            raise SegmentNotFound(f"{self.seg._what()} was unregistered") from None
        return self.seg

    def __exit__(self, *exc: object) -> None:
        self.seg.release()
