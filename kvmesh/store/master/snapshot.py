"""The snapshot codec of :class:`~.state.StoreStateMachine` (``snapshot_chunks``,
``restore``, ``digest``).

Snapshots are CRC-framed chunks (``kvmesh.replog.pack_chunk``): a header (config,
segments with their free extents, held bytes, the PROCESSING keys, the table's free rows,
writers' reservations)
then the object table's rows, column by column, encoded lazily from the live table with
copy-on-write of changed rows (:meth:`Snapshots.snapshot_chunks`, ``table.py``). Images of
formats 1 and 2 (one record per object) still restore.
"""

from __future__ import annotations

import gc
import struct
from collections.abc import Iterator

import crc32c
import msgspec
import numpy as np

from ...replog import SnapshotCorruptionError, iter_chunks, pack_chunk
from .allocator import SegmentAllocator
from .config import MasterConfig
from .objects import Obj, State
from .segments import Segment
from .table import Rows, Table

__all__ = ["CHUNK_ITEMS", "SNAPSHOT_FORMAT", "Snapshots"]

CHUNK_ITEMS = 50_000
SNAPSHOT_FORMAT = 3
# 1: no PROCESSING list in the header (states from the records); 2: one record per object
# (key list, Obj list per chunk); 3: the table's rows column by column (table.Rows)
_FORMATS = (1, 2, 3)
_C = int(State.COMPLETE)


class _SegRec(msgspec.Struct, array_like=True, frozen=True, gc=False, omit_defaults=True):
    id: int
    name: str
    node_id: str
    endpoint: str
    host_id: str
    size: int
    state: str
    deadline: float
    generation: int
    free: list[int]  # start, end, start, end, ...
    # "memory", "disk", or "disk/<disk id>" for a disk with an id (re-adoption): the id
    # rides in this field because msgspec encodes every field of an array-like record,
    # defaults too, and a new field would change the bytes of every image without one
    medium: str = "memory"


class _Header(msgspec.Struct, array_like=True, frozen=True):
    format: int
    config: MasterConfig
    applied: int
    next_seg: int
    segments: list[_SegRec]
    held: list[tuple[int, list[int]]]  # tag -> seg id, offset, length, ...
    objects: int
    retired: dict[str, float] = {}
    # format 2: the PROCESSING keys, oldest put first (every other key is COMPLETE; a
    # record's own ``state`` is the state it was written with, see ``objects.Obj``)
    processing: list[str] | None = None
    # format 3: the table's rows (live and free) and its free rows, last freed last
    rows: int = 0
    free: bytes = b""
    # writers' reservations: tag -> seg id, offset, length, ... (none before them)
    reserved: list[tuple[int, list[int]]] = []


_enc = msgspec.msgpack.Encoder()
_hdr_dec = msgspec.msgpack.Decoder(_Header)
_chunk_dec = msgspec.msgpack.Decoder(tuple[list[str], list[Obj]])  # formats 1 and 2
_rows_dec = msgspec.msgpack.Decoder(Rows)


class Snapshots:
    """The snapshot codec of :class:`~.state.StoreStateMachine`."""

    def snapshot_chunks(self) -> Iterator[bytes]:
        """Consistent image at the current applied index: the header (segments, held bytes,
        the PROCESSING list, the table's free rows) is encoded now; the table's rows are
        encoded lazily, :data:`~.table.CHUNK_ROWS` rows per ``next()``, straight from the
        columns, rows changed meanwhile as they were (copy-on-write, see table.py)."""
        rows, free, body = self.objects.image()
        header = pack_chunk(_enc.encode(self._header(rows, free)))

        def gen() -> Iterator[bytes]:
            yield header
            for c in body:
                yield pack_chunk(c)

        return gen()

    def snapshot(self) -> bytes:
        return b"".join(self.snapshot_chunks())

    def restore(self, data: bytes) -> None:
        """Replace the whole state with a snapshot image (``SnapshotCorruptionError`` if a
        chunk fails its CRC or the image is incomplete). Images of formats 1 and 2 (one
        record per object) restore too, into the table in their key order. ``data``: any
        bytes-like buffer (decoded chunk by chunk in place, not copied)."""
        # Restoring allocates a tuple per row (zip) and lists of millions of keys: each
        # allocation round would run the cyclic GC over them, doubling the restore time,
        # and nothing made here is garbage of a cycle.
        was = gc.isenabled()
        gc.disable()
        try:
            self._restore(data)
        finally:
            if was:
                gc.enable()

    def _restore(self, data: bytes) -> None:
        chunks = iter_chunks(data)
        try:
            first = next(chunks)
        except StopIteration:
            raise SnapshotCorruptionError("store snapshot: empty image") from None
        try:
            hdr = _hdr_dec.decode(first)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise SnapshotCorruptionError(f"store snapshot: bad header: {e}") from None
        if hdr.format not in _FORMATS or (hdr.format >= 2) != (hdr.processing is not None):
            raise SnapshotCorruptionError(
                f"store snapshot: format {hdr.format}, expected one of {_FORMATS}"
            )
        processing: dict[str, int] = {}
        table = Table(processing)
        pkeys = hdr.processing
        try:
            if hdr.format >= 3:
                if len(hdr.free) % 8:
                    raise ValueError("free rows not int64")
                free = np.frombuffer(hdr.free, "<i8")
                live = table.load_rows(hdr.rows, free, map(_rows_dec.decode, chunks))
            else:
                busy: list[tuple[int, str]] = []  # format 1: records carry their states
                for chunk in chunks:
                    ks, vs = _chunk_dec.decode(chunk)
                    if len(ks) != len(vs) or any(len(o.layout) % 12 or not o.layout for o in vs):
                        raise ValueError("bad records chunk")
                    table.load_records(ks, vs)
                    busy.extend((o.version, k) for k, o in zip(ks, vs) if o.state != _C)
                # oldest put first is (version, key) order
                pkeys = [k for _, k in sorted(busy)]
                live = len(table)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            raise SnapshotCorruptionError(f"store snapshot: bad object chunk: {e}") from None
        if live != hdr.objects:
            raise SnapshotCorruptionError(
                f"store snapshot: {live} objects, header says {hdr.objects}"
            )
        self.config = hdr.config
        self.applied = hdr.applied
        self.next_seg = hdr.next_seg
        self.segs = {}
        self.by_name = {}
        for r in hdr.segments:
            free_ext = list(zip(r.free[0::2], r.free[1::2]))
            alloc = SegmentAllocator(r.size, self.config.align, free=free_ext)
            seg = Segment(
                r.id,
                r.name,
                r.node_id,
                r.endpoint,
                r.host_id,
                r.size,
                alloc,
                r.state,
                r.deadline,
                r.generation,
                *_split_medium(r.medium),
            )
            self.segs[r.id] = seg
            self.by_name[r.name] = r.id
        self.retired = dict(hdr.retired)
        self.held = {
            tag: [tuple(flat[i : i + 3]) for i in range(0, len(flat), 3)] for tag, flat in hdr.held
        }  # type: ignore[misc]
        self.reserved = {
            tag: [tuple(flat[i : i + 3]) for i in range(0, len(flat), 3)]
            for tag, flat in hdr.reserved
        }  # type: ignore[misc]
        self.objects = table
        try:
            self._rebuild_indexes(pkeys or [], processing)
        except (KeyError, struct.error) as e:
            raise SnapshotCorruptionError(f"store snapshot: inconsistent image: {e!r}") from None

    def digest(self) -> int:
        """Checksum of the whole replicated state (replicas must agree)."""
        h = 0
        for c in self.snapshot_chunks():
            h = crc32c.crc32c(c, h)
        return h

    def _header(self, rows: int, free: np.ndarray) -> _Header:
        segs = []
        for s in self.segs.values():
            flat: list[int] = []
            for a, b in s.alloc.free_extents():
                flat.append(a)
                flat.append(b)
            segs.append(
                _SegRec(
                    s.id,
                    s.name,
                    s.node_id,
                    s.endpoint,
                    s.host_id,
                    s.size,
                    s.state,
                    s.deadline,
                    s.generation,
                    flat,
                    f"{s.medium}/{s.disk_id}" if s.disk_id else s.medium,
                )
            )
        held = [(tag, [x for t in ext for x in t]) for tag, ext in self.held.items()]
        return _Header(
            SNAPSHOT_FORMAT,
            self.config,
            self.applied,
            self.next_seg,
            segs,
            held,
            len(self.objects),
            dict(self.retired),
            list(self.processing),
            rows,
            free.astype("<i8").tobytes(),
            [(tag, [x for t in ext for x in t]) for tag, ext in self.reserved.items()],
        )

    def _rebuild_indexes(self, pkeys: list[str], processing: dict[str, int]) -> None:
        """Segment slice counts, the PROCESSING index (filled into ``processing``, the
        table's) and the COMPLETE count of a restored table; ``pkeys``: the image's
        PROCESSING keys, oldest put first."""
        segs = self.segs
        t = self.objects
        index, version = t.index, t.version
        for k in pkeys:
            processing[k] = version.item(index[k])  # KeyError: an inconsistent image
        if len(processing) != len(pkeys):
            raise KeyError("a PROCESSING key listed twice")
        for s in segs.values():
            s.slices = 0
        for sid, count in t.slice_counts().items():
            segs[sid].slices = count  # KeyError: a slice in a segment the image lacks
        self.processing = processing
        self.complete = len(t) - len(processing)


def _split_medium(field: str) -> tuple[str, str]:
    """A segment record's medium field -> (medium, disk id)."""
    medium, _, disk_id = field.partition("/")
    return medium, disk_id
