"""Snapshot files, written atomically and verified on read; chunk framing for snapshot blobs.

File format (``snap-{index:016x}-{term:016x}.snap``)::

    b"KVMSNAP1"
    [len u32][crc32c u32][SnapHeader msgpack]      format version, index, term, conf state, sizes
    [len u32][crc32c u32][data chunk]   x N        the state-machine image, in non-empty pieces
                                                   (chunk_bytes each, or as the writer got them)
    [len u32][crc32c u32][SnapTrailer msgpack]     chunk count, data length, crc32c of all data

A file is created as ``*.tmp``, fsynced, renamed into place and the directory fsynced, so a
file with the final name is complete; a leftover ``*.tmp`` is garbage from a crash and is
removed by :func:`cleanup_tmp`. Any CRC/length mismatch on read raises
:class:`SnapshotCorruptionError` (the caller decides whether an older snapshot + WAL can
stand in; it never loads a damaged image).

:func:`pack_chunk` / :func:`iter_chunks` frame the *inside* of a snapshot blob the same way,
for state machines that encode their image in pieces (see ``kvsm.py``).
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterable, Iterator

import crc32c
import msgspec

from ..errors import SnapshotCorruptionError
from ..types import ConfState, Snapshot, SnapshotMeta
from .wal import fsync_dir

__all__ = [
    "SnapshotCorruptionError",
    "SnapshotFileInfo",
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

FORMAT_VERSION = 1
_MAGIC = b"KVMSNAP1"
_HDR = struct.Struct("<II")
_NAME = re.compile(r"^snap-([0-9a-f]{16})-([0-9a-f]{16})\.snap$")


class SnapHeader(msgspec.Struct, array_like=True, frozen=True):
    version: int
    index: int
    term: int
    conf_state: ConfState
    data_len: int
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


def write_snapshot(
    dirpath: str, snap: Snapshot, chunk_bytes: int = 1 << 20, parts: list[bytes] | None = None
) -> str:
    """Durably write ``snap`` into ``dirpath``; returns the final path.

    ``parts``: the image as a list of pieces (written as they are, without joining them
    into one buffer first; ``snap.data`` is then ignored). Otherwise ``snap.data`` is cut
    into ``chunk_bytes`` chunks. Order: write ``*.tmp`` -> fsync -> rename -> fsync the
    directory. Raises ``OSError`` on any I/O failure (callers treat that as fatal). The
    CRC work releases the GIL, so this may run in a worker thread."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    os.makedirs(dirpath, exist_ok=True)
    meta = snap.meta
    final = os.path.join(dirpath, _name(meta.index, meta.term))
    tmp = final + ".tmp"
    if parts is None:
        data = memoryview(snap.data)
        pieces: list = [data[lo : lo + chunk_bytes] for lo in range(0, len(data), chunk_bytes)]
    else:
        pieces = [p for p in parts if len(p)]
    total = sum(len(p) for p in pieces)
    header = _enc.encode(
        SnapHeader(FORMAT_VERSION, meta.index, meta.term, meta.conf_state, total, chunk_bytes)
    )
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20, closefd=False) as f:
            f.write(_MAGIC)
            f.write(pack_chunk(header))
            crc = 0
            for piece in pieces:
                f.write(_HDR.pack(len(piece), crc32c.crc32c(piece)))
                f.write(piece)
                crc = crc32c.crc32c(piece, crc)
            f.write(pack_chunk(_enc.encode(SnapTrailer(len(pieces), total, crc))))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, final)
    fsync_dir(dirpath)
    return final


def _read_frame(buf: memoryview, pos: int, path: str, what: str) -> tuple[memoryview, int]:
    if len(buf) - pos < 8:
        raise SnapshotCorruptionError(f"{path}: truncated before the {what}")
    length, want = _HDR.unpack_from(buf, pos)
    end = pos + 8 + length
    if end > len(buf):
        raise SnapshotCorruptionError(
            f"{path}: {what} at offset {pos} runs past the end of the file"
        )
    payload = buf[pos + 8 : end]
    if crc32c.crc32c(payload) != want:
        raise SnapshotCorruptionError(f"{path}: CRC mismatch in the {what} at offset {pos}")
    return payload, end


def _parse_header(buf: memoryview, path: str) -> tuple[SnapHeader, int]:
    if bytes(buf[:8]) != _MAGIC:
        raise SnapshotCorruptionError(f"{path}: not a kvmesh snapshot file (bad magic)")
    raw, pos = _read_frame(buf, 8, path, "header")
    try:
        hdr = _hdr_dec.decode(raw)
    except msgspec.DecodeError as e:
        raise SnapshotCorruptionError(f"{path}: undecodable header: {e}") from e
    if hdr.version != FORMAT_VERSION:
        raise SnapshotCorruptionError(f"{path}: unsupported snapshot format version {hdr.version}")
    return hdr, pos


def read_snapshot_meta(path: str) -> SnapshotMeta:
    """Header only (cheap); does not verify the data."""
    with open(path, "rb") as f:
        head = f.read(4096)
    hdr, _ = _parse_header(memoryview(head), path)
    return SnapshotMeta(hdr.index, hdr.term, hdr.conf_state)


def read_snapshot(path: str) -> Snapshot:
    """Read and fully verify a snapshot file."""
    with open(path, "rb") as f:
        buf = memoryview(f.read())
    hdr, pos = _parse_header(buf, path)
    m = _NAME.match(os.path.basename(path))
    if m and (int(m.group(1), 16), int(m.group(2), 16)) != (hdr.index, hdr.term):
        raise SnapshotCorruptionError(
            f"{path}: header says index {hdr.index} term {hdr.term}, name disagrees"
        )
    out = bytearray()
    chunks = 0
    while len(out) < hdr.data_len:
        piece, pos = _read_frame(buf, pos, path, f"data chunk {chunks}")
        if not len(piece):
            raise SnapshotCorruptionError(f"{path}: empty data chunk {chunks}")
        out += piece
        chunks += 1
    raw, pos = _read_frame(buf, pos, path, "trailer")
    try:
        trl = _trl_dec.decode(raw)
    except msgspec.DecodeError as e:
        raise SnapshotCorruptionError(f"{path}: undecodable trailer: {e}") from e
    if pos != len(buf):
        raise SnapshotCorruptionError(
            f"{path}: {len(buf) - pos} unexpected bytes after the trailer"
        )
    if trl.chunks != chunks or trl.data_len != hdr.data_len or len(out) != hdr.data_len:
        raise SnapshotCorruptionError(f"{path}: trailer/header size mismatch")
    data = bytes(out)
    if crc32c.crc32c(data) != trl.data_crc:
        raise SnapshotCorruptionError(f"{path}: whole-data CRC mismatch")
    return Snapshot(SnapshotMeta(hdr.index, hdr.term, hdr.conf_state), data)


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
