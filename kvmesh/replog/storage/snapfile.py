"""Snapshot files, written atomically and verified on read; chunk framing for snapshot blobs.

File format (``snap-{index:016x}-{term:016x}.snap``), version 2::

    b"KVMSNAP1"
    [len u32][crc32c u32][SnapHeader msgpack]      format version, index, term, conf state
    [len u32][crc32c u32][data chunk]   x N        the state-machine image, in non-empty pieces
                                                   (chunk_bytes each, or as the writer got them)
    [0 u32][0 u32]                                 end of the data (an empty frame)
    [len u32][crc32c u32][SnapTrailer msgpack]     chunk count, data length, crc32c of all data

The sizes come last, so a writer streams the image piece by piece as it is encoded
(:class:`SnapshotWriter`) and never holds all of it. Version 1 files (the data length in
the header, no end frame) still read.

A file is created as ``*.tmp``, fsynced, renamed into place and the directory fsynced, so a
file with the final name is complete; a leftover ``*.tmp`` is garbage from a crash and is
removed by :func:`cleanup_tmp`. Any CRC/length mismatch on read raises
:class:`SnapshotCorruptionError` (the caller decides whether an older snapshot + WAL can
stand in; it never loads a damaged image). :func:`read_snapshot` reads the pieces straight
into one buffer: the image is in memory once.

:func:`pack_chunk` / :func:`iter_chunks` frame the *inside* of a snapshot blob the same way,
for state machines that encode their image in pieces (see ``kvsm.py``).
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import crc32c
import msgspec

from ..errors import SnapshotCorruptionError
from ..types import ConfState, Snapshot, SnapshotMeta
from .wal import fsync_dir

__all__ = [
    "SnapshotCorruptionError",
    "SnapshotFileInfo",
    "SnapshotWriter",
    "FORMAT_VERSION",
    "write_snapshot",
    "read_snapshot",
    "read_snapshot_meta",
    "list_snapshots",
    "remove_snapshots_except",
    "cleanup_tmp",
    "pack_chunk",
    "iter_chunks",
]

FORMAT_VERSION = 2
_VERSIONS = (1, 2)  # 1: data_len in the header, no end frame
_MAGIC = b"KVMSNAP1"
_HDR = struct.Struct("<II")
_NAME = re.compile(r"^snap-([0-9a-f]{16})-([0-9a-f]{16})\.snap$")


class SnapHeader(msgspec.Struct, array_like=True, frozen=True):
    version: int
    index: int
    term: int
    conf_state: ConfState
    data_len: int  # version 1 only (2: 0, the length is in the trailer)
    chunk_bytes: int


class SnapTrailer(msgspec.Struct, array_like=True, frozen=True):
    chunks: int
    data_len: int
    data_crc: int


class SnapshotFileInfo(msgspec.Struct, frozen=True):
    index: int
    term: int
    path: str


_enc = msgspec.msgpack.Encoder()
_hdr_dec = msgspec.msgpack.Decoder(SnapHeader)
_trl_dec = msgspec.msgpack.Decoder(SnapTrailer)


def pack_chunk(payload: bytes) -> bytes:
    """Frame one chunk of a snapshot blob: ``[len u32][crc32c u32][payload]``."""
    return _HDR.pack(len(payload), crc32c.crc32c(payload)) + payload


def iter_chunks(data: bytes | memoryview) -> Iterator[memoryview]:
    """Verify and yield the chunks of a blob made with :func:`pack_chunk`."""
    mv = memoryview(data)
    pos, n = 0, len(mv)
    while pos < n:
        if n - pos < 8:
            raise SnapshotCorruptionError(f"snapshot blob: partial chunk header at offset {pos}")
        length, want = _HDR.unpack_from(mv, pos)
        end = pos + 8 + length
        if end > n:
            raise SnapshotCorruptionError(f"snapshot blob: chunk at offset {pos} runs past the end")
        chunk = mv[pos + 8 : end]
        if crc32c.crc32c(chunk) != want:
            raise SnapshotCorruptionError(f"snapshot blob: CRC mismatch in chunk at offset {pos}")
        yield chunk
        pos = end


def _name(index: int, term: int) -> str:
    return f"snap-{index:016x}-{term:016x}.snap"


class SnapshotWriter:
    """One snapshot file written piece by piece (blocking; any one thread at a time):
    :meth:`write` each piece of the image as it is made, then :meth:`finish` (trailer,
    fsync, rename, directory fsync: returns the final path) or :meth:`abort`. ``OSError``
    on any I/O failure (callers treat that as fatal). The CRC work releases the GIL."""

    def __init__(self, dirpath: str, meta: SnapshotMeta, chunk_bytes: int = 1 << 20) -> None:
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        os.makedirs(dirpath, exist_ok=True)
        self.dirpath = dirpath
        self.final = os.path.join(dirpath, _name(meta.index, meta.term))
        self.tmp = self.final + ".tmp"
        self.chunks = 0
        self.data_len = 0
        self._crc = 0
        header = _enc.encode(
            SnapHeader(FORMAT_VERSION, meta.index, meta.term, meta.conf_state, 0, chunk_bytes)
        )
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._f = os.fdopen(fd, "wb", buffering=1 << 20)
        try:
            self._f.write(_MAGIC)
            self._f.write(pack_chunk(header))
        except BaseException:
            self.abort()
            raise

    def write(self, piece: bytes | memoryview) -> None:
        """Append one piece of the image (empty pieces are skipped)."""
        n = len(piece)
        if not n:
            return
        crc = crc32c.crc32c(piece)
        self._f.write(_HDR.pack(n, crc))
        self._f.write(piece)
        self._crc = crc32c.crc32c(piece, self._crc)
        self.chunks += 1
        self.data_len += n

    def finish(self) -> str:
        f = self._f
        try:
            f.write(_HDR.pack(0, 0))
            f.write(pack_chunk(_enc.encode(SnapTrailer(self.chunks, self.data_len, self._crc))))
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            self.abort()
            raise
        f.close()
        os.rename(self.tmp, self.final)
        fsync_dir(self.dirpath)
        return self.final

    def abort(self) -> None:
        """Drop the partial file (idempotent)."""
        try:
            self._f.close()
        except OSError:
            pass
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def write_snapshot(
    dirpath: str,
    snap: Snapshot,
    chunk_bytes: int = 1 << 20,
    parts: Iterable[bytes] | None = None,
) -> str:
    """Durably write ``snap`` into ``dirpath``; returns the final path.

    ``parts``: the image as pieces (written as they come, without joining them into one
    buffer; an iterator is consumed lazily; ``snap.data`` is then ignored). Otherwise
    ``snap.data`` is cut into ``chunk_bytes`` chunks. See :class:`SnapshotWriter`."""
    w = SnapshotWriter(dirpath, snap.meta, chunk_bytes)
    try:
        if parts is None:
            data = memoryview(snap.data)
            for lo in range(0, len(data), chunk_bytes):
                w.write(data[lo : lo + chunk_bytes])
        else:
            for p in parts:
                w.write(p)
    except BaseException:
        w.abort()
        raise
    return w.finish()


def _read_frame(f: BinaryIO, path: str, what: str) -> bytes:
    head = f.read(8)
    if len(head) < 8:
        raise SnapshotCorruptionError(f"{path}: truncated before the {what}")
    length, want = _HDR.unpack(head)
    payload = f.read(length)
    if len(payload) != length:
        raise SnapshotCorruptionError(f"{path}: {what} runs past the end of the file")
    if crc32c.crc32c(payload) != want:
        raise SnapshotCorruptionError(f"{path}: CRC mismatch in the {what}")
    return payload


def _parse_header(f: BinaryIO, path: str) -> SnapHeader:
    if f.read(8) != _MAGIC:
        raise SnapshotCorruptionError(f"{path}: not a kvmesh snapshot file (bad magic)")
    raw = _read_frame(f, path, "header")
    try:
        hdr = _hdr_dec.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SnapshotCorruptionError(f"{path}: undecodable header: {e}") from e
    if hdr.version not in _VERSIONS:
        raise SnapshotCorruptionError(f"{path}: unsupported snapshot format version {hdr.version}")
    return hdr


def read_snapshot_meta(path: str) -> SnapshotMeta:
    """Header only (cheap); does not verify the data."""
    with open(path, "rb") as f:
        hdr = _parse_header(f, path)
    return SnapshotMeta(hdr.index, hdr.term, hdr.conf_state)


def read_snapshot(path: str) -> Snapshot:
    """Read and fully verify a snapshot file. The pieces are read straight into one buffer
    (a ``bytearray`` as ``data``, sized from the file): no second copy of the image."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        hdr = _parse_header(f, path)  # type: ignore[arg-type]
        m = _NAME.match(os.path.basename(path))
        if m and (int(m.group(1), 16), int(m.group(2), 16)) != (hdr.index, hdr.term):
            raise SnapshotCorruptionError(
                f"{path}: header says index {hdr.index} term {hdr.term}, name disagrees"
            )
        v1 = hdr.version == 1
        # version 1 says how much data comes; version 2 ends it with an empty frame
        cap = hdr.data_len if v1 else max(0, size - f.tell())
        out = bytearray(cap)
        view = memoryview(out)
        head = bytearray(8)
        piece = None
        used = chunks = crc = 0
        while not v1 or used < hdr.data_len:
            what = f"data chunk {chunks}"
            if f.readinto(head) != 8:
                raise SnapshotCorruptionError(f"{path}: truncated before the {what}")
            length, want = _HDR.unpack(head)
            if not length:
                if v1 or want:
                    raise SnapshotCorruptionError(f"{path}: empty {what}")
                break
            if length > cap - used:
                raise SnapshotCorruptionError(f"{path}: {what} runs past the end of the file")
            piece = view[used : used + length]
            if _read_into(f, piece) != length:
                raise SnapshotCorruptionError(f"{path}: {what} runs past the end of the file")
            if crc32c.crc32c(piece) != want:
                raise SnapshotCorruptionError(f"{path}: CRC mismatch in the {what}")
            crc = crc32c.crc32c(piece, crc)
            used += length
            chunks += 1
        raw = _read_frame(f, path, "trailer")  # type: ignore[arg-type]
        try:
            trl = _trl_dec.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise SnapshotCorruptionError(f"{path}: undecodable trailer: {e}") from e
        extra = size - f.tell()
        if extra:
            raise SnapshotCorruptionError(f"{path}: {extra} unexpected bytes after the trailer")
    piece = view = None  # no export left: ``out`` can be resized
    if trl.chunks != chunks or trl.data_len != used or (v1 and used != hdr.data_len):
        raise SnapshotCorruptionError(f"{path}: trailer/header size mismatch")
    if crc != trl.data_crc:
        raise SnapshotCorruptionError(f"{path}: whole-data CRC mismatch")
    del out[used:]  # the frame headers' room: shrinks in place
    return Snapshot(SnapshotMeta(hdr.index, hdr.term, hdr.conf_state), out)  # type: ignore[arg-type]


def _read_into(f: BinaryIO, view: memoryview) -> int:
    """Fill ``view`` from ``f`` (raw reads may return less than asked)."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            break
        got += n
    return got


def list_snapshots(dirpath: str) -> list[SnapshotFileInfo]:
    """Complete (renamed) snapshot files, oldest first."""
    if not os.path.isdir(dirpath):
        return []
    out = []
    for name in os.listdir(dirpath):
        m = _NAME.match(name)
        if m:
            out.append(
                SnapshotFileInfo(
                    int(m.group(1), 16), int(m.group(2), 16), os.path.join(dirpath, name)
                )
            )
    out.sort(key=lambda s: (s.index, s.term))
    return out


def remove_snapshots_except(dirpath: str, keep: Iterable[str]) -> int:
    """Delete snapshot files not in ``keep`` (paths); returns how many. Durable."""
    keep = set(keep)
    n = 0
    for s in list_snapshots(dirpath):
        if s.path not in keep:
            os.unlink(s.path)
            n += 1
    if n:
        fsync_dir(dirpath)
    return n


def cleanup_tmp(dirpath: str) -> int:
    """Remove partial ``*.tmp`` files left by a crash mid-write."""
    if not os.path.isdir(dirpath):
        return 0
    n = 0
    for name in os.listdir(dirpath):
        if name.endswith(".snap.tmp"):
            os.unlink(os.path.join(dirpath, name))
            n += 1
    if n:
        fsync_dir(dirpath)
    return n
