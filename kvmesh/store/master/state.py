"""The store master's replicated state machine (kvmesh.replog ``StateMachine``).

:class:`StoreStateMachine` holds the object table (:class:`~.table.Table`, one row per
object), the mounted segments with one :class:`~.allocator.SegmentAllocator` each, and the
bytes held for leases by forced removes. ``apply`` executes one :mod:`.commands` entry; it
is deterministic (no clock, no global randomness: ``now`` and the log index come from the
entry), so every replica computes the same offsets. Read-only queries (:meth:`lookup`,
:meth:`exists`, :meth:`get_size`, :meth:`segments`, :meth:`usage`) serve the service
without a log entry; the service must have confirmed leadership (read index or lease) first.

Placement of one object (``_place``): the size is cut into slices of at most
``MasterConfig.slice_limit`` bytes; for each copy and each slice a segment is chosen among
the mounted segments whose largest free extent fits, whose node holds no other copy of the
object, preferring (1) ``preferred_segment`` for the first copy, (2) nodes already holding
this copy's earlier slices, then (3) the strategy: ``local`` = segments on ``writer_host``,
most free bytes first; ``most_free``; ``random`` = a SplitMix64 draw seeded by (log index,
key position, copy, slice). Inside the segment the allocator takes the best fit. If any slice
finds no segment, everything allocated for the object is returned and the key gets
``NoSpace`` (the service then evicts and retries).

Snapshots are CRC-framed chunks (``kvmesh.replog.pack_chunk``): a header (config,
segments with their free extents, held bytes, the PROCESSING keys, the table's free rows)
then the object table's rows, column by column, encoded lazily from the live table with
copy-on-write of changed rows (:meth:`snapshot_chunks`, ``table.py``).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Iterable, Iterator
from itertools import repeat
from typing import Any

import crc32c
import msgspec
import numpy as np
from msgspec.structs import replace

from ...replog import SnapshotCorruptionError, iter_chunks, pack_chunk
from ..errors import Code
from ..types import (
    MAX_BATCH_KEYS,
    MAX_KEY_BYTES,
    MAX_OBJECT_SIZE,
    MAX_REPLICAS,
    MAX_SLICES_PER_BATCH,
    ROW,
    LookupTable,
    ObjectLookup,
    ObjectReplica,
    ReplicaDesc,
    ReplicaRun,
    ReplicateConfig,
    SegmentInfo,
    Usage,
    key_error,
    keys_valid,
    replica_lists,
)
from .allocator import SegmentAllocator
from .commands import (
    Codes,
    Evict,
    EvictResult,
    ExpireNodes,
    ExpireResult,
    Mount,
    Pin,
    PutEnd,
    PutRevoke,
    PutStart,
    PutStartResult,
    PutStartRun,
    Reclaim,
    ReclaimResult,
    Release,
    Remove,
    RemoveAll,
    RemoveAllResult,
    RemovePrefix,
    RemovePrefixResult,
    Result,
    Unmount,
    Unpin,
    Upsert,
    decode_command,
)
from .objects import (
    PIN_HARD,
    PIN_NONE,
    PIN_SOFT,
    SLICE,
    Event,
    Obj,
    State,
    n_slices,
    next_state,
    pack_layout,
    slice_lengths,
    unpack_layout,
)
from .table import Rows, Table

__all__ = ["CHUNK_ITEMS", "SNAPSHOT_FORMAT", "MasterConfig", "StoreStateMachine"]

CHUNK_ITEMS = 50_000
SNAPSHOT_FORMAT = 3
# 1: no PROCESSING list in the header (states from the records); 2: one record per object
# (key list, Obj list per chunk); 3: the table's rows column by column (table.Rows)
_FORMATS = (1, 2, 3)
_P, _C = int(State.PROCESSING), int(State.COMPLETE)
_STRATEGIES = ("local", "random", "most_free")
MOUNTED, DRAINING = "mounted", "draining"
_M64 = (1 << 64) - 1
_NONE: frozenset[str] = frozenset()


class MasterConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Replicated configuration: every master replica must use the same one (a snapshot
    carries it and restore adopts it). ``slice_limit``: longest slice of one copy;
    ``align``: allocation granularity (power of two)."""

    slice_limit: int = 16 << 20
    align: int = 64
    remount_quarantine: float = 60.0
    """Seconds (of entry time) during which a dropped segment's name cannot be mounted
    again: a reader still copying under a lease from the old segment must not read the
    new segment's bytes at the same name and offsets, nor a writer that is still writing
    until its put timeout. Keep it >= max(read lease TTL, put timeout)."""


class _Seg:
    __slots__ = (
        "alloc",
        "deadline",
        "endpoint",
        "generation",
        "host_id",
        "id",
        "name",
        "node_id",
        "size",
        "slices",
        "state",
    )  # fmt: skip

    def __init__(self, sid: int, name: str, node_id: str, endpoint: str, host_id: str,
                 size: int, alloc: SegmentAllocator, state: str, deadline: float,
                 generation: int) -> None:  # fmt: skip
        self.id = sid
        self.name = name
        self.node_id = node_id
        self.endpoint = endpoint
        self.host_id = host_id
        self.size = size
        self.alloc = alloc
        self.state = state
        self.deadline = deadline
        self.generation = generation
        # (the keys placed here are the table's rows with this segment id: Table.rows_of)
        self.slices = 0  # slices of live objects placed here

    def info(self) -> SegmentInfo:
        return SegmentInfo(
            name=self.name, node_id=self.node_id, endpoint=self.endpoint, host_id=self.host_id,
            size=self.size, used=self.alloc.used, objects=self.slices, state=self.state,
            generation=self.generation, drain_deadline=self.deadline,
        )  # fmt: skip


class _SegRec(msgspec.Struct, array_like=True, frozen=True, gc=False):
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


_DESC_BYTES = 24  # msgpack framing and the two ints of one encoded ReplicaDesc (upper bound)


_SIMPLE_MIN = 16  # below this many keys numpy's per-call costs exceed the loop's per-key ones
_SLICE_DTYPE = np.dtype([("sid", "<u4"), ("off", "<u8")])  # SLICE ("<IQ") as numpy reads it
assert _SLICE_DTYPE.itemsize == SLICE.size


def _seg_cost(s: _Seg) -> int:
    """Reply-budget charge of one slice in segment ``s``: the larger of its encodings, a
    ReplicaDesc (names included) or a table row (``ROW`` int64), so both reply forms stay
    within the budget."""
    return max(_DESC_BYTES + len(s.name) + len(s.node_id) + len(s.endpoint), 8 * ROW)


_enc = msgspec.msgpack.Encoder()
_hdr_dec = msgspec.msgpack.Decoder(_Header)
_chunk_dec = msgspec.msgpack.Decoder(tuple[list[str], list[Obj]])  # formats 1 and 2
_rows_dec = msgspec.msgpack.Decoder(Rows)


def _mix(x: int) -> int:
    """SplitMix64 finaliser: a well-spread 64-bit hash of ``x`` (deterministic)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


_HANDLERS: dict[type, str] = {
    Mount: "_mount",
    Unmount: "_unmount",
    ExpireNodes: "_expire",
    PutStart: "_put_start",
    Upsert: "_upsert",
    PutEnd: "_put_end",
    PutRevoke: "_put_revoke",
    Remove: "_remove",
    RemoveAll: "_remove_all",
    Reclaim: "_reclaim",
    Evict: "_evict",
    Pin: "_pin",
    Unpin: "_unpin",
    Release: "_release",
    RemovePrefix: "_remove_prefix",
}
"""Command type -> handler method name (looked up per call, so a test can patch a handler
on the class, as the simulator's negative controls do)."""


class StoreStateMachine:
    """Deterministic store metadata; see the module docstring. ``apply`` never raises for a
    well-formed entry: bad input gets per-key codes."""

    result_type: Any = Result

    def __init__(self, config: MasterConfig | None = None) -> None:
        self.config = config or MasterConfig()
        self.segs: dict[int, _Seg] = {}  # by id, in mount order
        self.by_name: dict[str, int] = {}
        # PROCESSING key -> its version, oldest put first. THE state of an object: a key of
        # the table is PROCESSING iff it is here, else COMPLETE (PutEnd only pops it here and
        # never rewrites the record: one lookup in this small dict instead of a lookup and a
        # rewrite in the big table). ``Obj.state`` is the state a record was written with.
        self.processing: dict[str, int] = {}
        self.objects = Table(self.processing)  # key -> record view; see table.py
        self.held: dict[int, list[tuple[int, int, int]]] = {}  # tag -> (seg id, offset, length)
        self.retired: dict[str, float] = {}  # dropped segment name -> entry time of the drop
        self.next_seg = 1
        self.applied = 0
        self.complete = 0
        # keys named by the entries this replica applied since it started (not replicated
        # state: the driver uses it to snapshot by work done, as one entry may hold thousands)
        self.applied_keys = 0

    # ================================================================== replog protocol

    def apply(self, index: int, data: bytes) -> Result:
        """Apply one encoded command (log entry ``index``) and return its result."""
        self.applied = index
        try:
            cmd = decode_command(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return Codes([int(Code.INVALID_PARAMS)])
        self.applied_keys += len(getattr(cmd, "keys", ()))
        return getattr(self, _HANDLERS[type(cmd)])(index, cmd)

    # ================================================================== read-only queries

    def lookup(
        self, keys: Iterable[str], host: str | None = None, max_bytes: int | None = None
    ) -> list[ObjectLookup]:
        """Per key: its COMPLETE copies (``ObjectNotFound`` for absent or PROCESSING keys).
        With ``host``, copies having a slice on that host come first.

        ``max_bytes`` bounds the replica descriptors of the whole answer (estimated encoded
        bytes): a small request naming big objects, or one key many times, must not make a
        reply of gigabytes. The first found key is always answered (one object's copies
        are bounded by ``MAX_SLICES_PER_BATCH``); a later key that would pass the budget
        answers ``InvalidParams`` (ask for it in another request).

        The same answer as :meth:`lookup_table` (which it is built from), as objects."""
        t = self.lookup_table(keys, host, max_bytes)
        return [
            ObjectLookup(c, z, reps, v) if c == 0 else ObjectLookup(c)
            for c, z, v, reps in zip(t.codes, t.sizes, t.versions, replica_lists(t))
        ]

    def lookup_table(
        self, keys: Iterable[str], host: str | None = None, max_bytes: int | None = None
    ) -> LookupTable:
        """:meth:`lookup` without a Python object per replica (the read hot path): per key a
        code, size and version, the segments named (each once), and ``rows``, :data:`ROW`
        int64 per slice -- key index, copy index, segment index (into ``segments``), offset,
        length -- grouped by key in key order, copies in preference order (copies with a
        slice on ``host`` first), slices in byte order. ``max_bytes``: as in :meth:`lookup`
        (the same per-slice estimate, so both forms refuse the same keys)."""
        keys = keys if type(keys) is list else list(keys)
        if len(keys) >= _SIMPLE_MIN:
            fast = self._lookup_simple(keys, max_bytes)
            if fast is not None:
                return fast
        elif len(keys) == 1 and (max_bytes is None or max_bytes > 0):
            # The first key is always answered whatever its cost, as in the loop below.
            one = self._lookup_one(keys[0])
            if one is not None:
                return one
        codes: list[int] = []
        sizes: list[int] = []
        versions: list[int] = []
        rows = array("q")
        index: dict[int, int] = {}  # segment id -> position in `named`
        named: list[_Seg] = []
        costs: list[int] = []  # budget charge of one slice in named[x]
        objs = self.objects
        segs = self.segs
        lim = self.config.slice_limit
        unpack = SLICE.unpack
        not_found, refused = int(Code.OBJECT_NOT_FOUND), int(Code.INVALID_PARAMS)
        proc = self.processing
        spent = 0
        for i, k in enumerate(keys):
            o = objs.get(k) if type(k) is str else None
            if o is None or k in proc:
                codes.append(not_found)
                sizes.append(0)
                versions.append(0)
                continue
            if max_bytes is not None and spent >= max_bytes:
                codes.append(refused)
                sizes.append(0)
                versions.append(0)
                continue
            lay = o.layout
            if len(lay) == 12 and o.size <= lim:  # one copy of one slice: the common case
                sid, off = unpack(lay)
                x = index.get(sid)
                if x is None:
                    x = index[sid] = len(named)
                    s = segs[sid]
                    named.append(s)
                    costs.append(_seg_cost(s))
                new: Any = (i, 0, x, off, o.size)
                cost = costs[x]
            else:
                new, cost = self._rows(i, o, host, index, named, costs)
            if max_bytes is not None:
                if spent and spent + cost > max_bytes:
                    spent = max_bytes  # keep the answer in key order: no later key either
                    codes.append(refused)
                    sizes.append(0)
                    versions.append(0)
                    continue
                spent += cost
            rows.extend(new)
            codes.append(0)
            sizes.append(o.size)
            versions.append(o.version)
        return LookupTable(
            codes,
            sizes,
            versions,
            [(s.name, s.node_id, s.endpoint) for s in named],
            np.frombuffer(rows, np.int64).reshape(-1, ROW),  # 'q' is int64 in native order
        )

    def _lookup_one(self, k: str) -> LookupTable | None:
        """:meth:`lookup_table` of a single get of a COMPLETE object of one copy in one slice,
        without the loop's set-up; None for anything else (the loop answers it)."""
        t = self.objects
        r = t.index.get(k) if type(k) is str else None
        if r is None or k in self.processing:
            return None
        sid = t.sid.item(r)
        size = t.size.item(r)
        if not sid or size > self.config.slice_limit:
            return None
        s = self.segs[sid]
        return LookupTable(
            [0],
            [size],
            [t.version.item(r)],
            [(s.name, s.node_id, s.endpoint)],
            np.array([(0, 0, 0, t.off.item(r), size)], np.int64),
        )

    def _lookup_simple(self, keys: list[str], max_bytes: int | None) -> LookupTable | None:
        """:meth:`lookup_table` of the common batch -- every key a COMPLETE object of one
        copy in one slice, within the reply budget -- with column gathers instead of a
        Python loop per key; None when the batch is anything else (the loop answers it)."""
        if not keys or set(map(type, keys)) != {str}:
            return None
        t = self.objects
        got = list(map(t.index.get, keys))
        proc = self.processing
        if None in got or (proc and not proc.keys().isdisjoint(keys)):
            return None
        at = np.array(got, np.int64)
        sid = t.sid[at]
        size = t.size[at]
        if not sid.all() or int(size.max()) > self.config.slice_limit:
            return None
        first = int(sid[0])
        if int(sid.min()) == first == int(sid.max()):  # one segment (usual): no sort
            uniq, xs = np.array([first]), np.zeros(len(sid), np.int64)
        else:
            uniq = np.unique(sid)  # sorted; few distinct segments, so no inverse pass
            xs = np.searchsorted(uniq, sid)
        named = [self.segs[sid] for sid in uniq.tolist()]
        if max_bytes is not None:
            costs = np.asarray([_seg_cost(s) for s in named], np.int64)
            if int(costs[xs].sum()) > max_bytes:
                return None  # the loop refuses the keys past the budget, in key order
        n = len(keys)
        rows = np.zeros((n, ROW), np.int64)
        rows[:, 0] = np.arange(n)
        rows[:, 2] = xs
        rows[:, 3] = t.off[at]
        rows[:, 4] = size
        return LookupTable(
            [0] * n,
            size.tolist(),
            t.version[at].tolist(),
            [(s.name, s.node_id, s.endpoint) for s in named],
            rows,
        )

    def _rows(
        self,
        i: int,
        o: Obj,
        host: str | None,
        index: dict[int, int],
        named: list[_Seg],
        costs: list[int],
    ) -> tuple[list[int], int]:
        """:meth:`lookup_table`'s rows of object ``o`` (key index ``i``) and their cost."""
        lens = slice_lengths(o.size, self.config.slice_limit)
        segs = self.segs
        near: list[list[int]] = []
        far: list[list[int]] = []
        cost = 0
        for copy in unpack_layout(o.layout, len(lens)):
            cur: list[int] = []
            on_host = False
            for (sid, off), ln in zip(copy, lens):
                x = index.get(sid)
                if x is None:
                    x = index[sid] = len(named)
                    named.append(segs[sid])
                    costs.append(_seg_cost(segs[sid]))
                s = named[x]
                cost += costs[x]
                cur += (i, 0, x, off, ln)
                on_host = on_host or (host is not None and s.host_id == host)
            (near if on_host else far).append(cur)
        out: list[int] = []
        for c, cur in enumerate(near + far):
            cur[1::ROW] = [c] * (len(cur) // ROW)
            out += cur
        return out, cost

    def exists(self, keys: Iterable[str]) -> list[bool]:
        """COMPLETE objects only."""
        ks = keys if type(keys) is list else list(keys)
        objs, proc = self.objects.index, self.processing
        if set(map(type, ks)) <= {str}:  # what the service decodes: no per-key type test
            if not proc:
                return [k in objs for k in ks]
            return [k in objs and k not in proc for k in ks]
        return [type(k) is str and k in objs and k not in proc for k in ks]

    def exists_flags(self, keys: list[str]) -> list[int]:
        """:meth:`exists` as the wire's 1 / 0 per key, for keys the caller checked are all
        ``str`` (the service's decoded requests): one pass, no type test per batch and no
        second pass from bools to ints."""
        objs, proc = self.objects.index, self.processing
        if not proc:
            return [1 if k in objs else 0 for k in keys]
        return [1 if k in objs and k not in proc else 0 for k in keys]

    def exists_codes(self, prefix: str, keys: list[str], suffixes: list[str]) -> list[int]:
        """Per name ``prefix + key + suffix`` (key-major, every suffix): 1 for a COMPLETE
        object, else 0. The names are built and looked up in one pass (no list of names,
        no per-key type test: the service checked the parts, all ``str``)."""
        objs, proc = self.objects.index, self.processing
        if len(suffixes) == 1:
            s = suffixes[0]
            return [1 if (n := f"{prefix}{k}{s}") in objs and n not in proc else 0 for k in keys]
        return [
            1 if (n := f"{prefix}{k}{s}") in objs and n not in proc else 0
            for k in keys
            for s in suffixes
        ]

    def exists_leading(self, prefix: str, keys: list[str], suffixes: list[str]) -> int:
        """The number of leading keys whose every name ``prefix + key + suffix`` is a
        COMPLETE object (:meth:`exists_codes` up to its first 0, divided by the suffixes).
        Stops at the first missing name; one flat loop (no list of codes), the parts
        checked by the service as for :meth:`exists_codes`."""
        objs, proc = self.objects.index, self.processing
        if len(suffixes) == 1:
            s = suffixes[0]
            for i, k in enumerate(keys):
                n = f"{prefix}{k}{s}"
                if n not in objs or n in proc:
                    return i
            return len(keys)
        for i, k in enumerate(keys):
            for s in suffixes:
                n = f"{prefix}{k}{s}"
                if n not in objs or n in proc:
                    return i
        return len(keys)

    def get_size(self, keys: Iterable[str]) -> list[int]:
        """Per key: the size of a COMPLETE object, else ``Code.OBJECT_NOT_FOUND``."""
        objs, proc = self.objects.index, self.processing
        size = self.objects.size
        nf = int(Code.OBJECT_NOT_FOUND)
        out = []
        for k in keys:
            r = objs.get(k) if type(k) is str else None
            out.append(size.item(r) if r is not None and k not in proc else nf)
        return out

    def state_of(self, key: str) -> State:
        if key not in self.objects:
            return State.GONE
        return State.PROCESSING if key in self.processing else State.COMPLETE

    def version_of(self, key: str) -> int:
        r = self.objects.index.get(key) if type(key) is str else None
        return 0 if r is None else self.objects.version.item(r)

    def segments(self) -> list[SegmentInfo]:
        return [s.info() for s in self.segs.values()]

    def nodes(self) -> dict[str, list[str]]:
        """node id -> names of its segments (mounted or draining)."""
        out: dict[str, list[str]] = {}
        for s in self.segs.values():
            out.setdefault(s.node_id, []).append(s.name)
        return out

    def usage(self) -> Usage:
        cap = used = 0
        for s in self.segs.values():
            cap += s.alloc.size
            used += s.alloc.used
        a = self.config.align
        held = sum((ln + a - 1) & -a for v in self.held.values() for _, _, ln in v)
        return Usage(
            capacity=cap, used=used, objects=len(self.objects), complete=self.complete,
            processing=len(self.processing), segments=len(self.segs), held_bytes=held,
        )  # fmt: skip

    def object_count(self) -> int:
        return len(self.objects)

    def keys(self) -> Iterator[str]:
        """All keys (PROCESSING included), in table order (a copy: safe across applies)."""
        return iter(self.objects.key_list())

    def key_list(self) -> list[str]:
        """All keys in table order (row order, see table.py), as a new list."""
        return self.objects.key_list()

    def processing_puts(self) -> list[tuple[str, int]]:
        """``(key, version)`` of every PROCESSING put, oldest first."""
        return list(self.processing.items())

    def held_tags(self) -> list[int]:
        """Log indices of hold removes whose bytes are not yet released."""
        return list(self.held)

    def evict_info(self, key: str) -> tuple[int, int, int, float] | None:
        """``(version, allocated bytes, pin, pin_until)`` of a COMPLETE object, else None."""
        o = self.objects.get(key)
        if o is None or key in self.processing:
            return None
        return o.version, self._bytes(o), o.pin, o.pin_until

    def placement(self, key: str) -> list[list[tuple[str, int, int]]]:
        """Per copy, per slice ``(segment, offset, length)`` of any object (tests, tools)."""
        o = self.objects.get(key)
        if o is None:
            return []
        lim = self.config.slice_limit
        lens = slice_lengths(o.size, lim)
        return [
            [(self.segs[sid].name, off, ln) for (sid, off), ln in zip(copy, lens)]
            for copy in unpack_layout(o.layout, len(lens))
        ]

    # ================================================================== snapshots

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
        record per object) restore too, into the table in their key order."""
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
            seg = _Seg(
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
            )
            self.segs[r.id] = seg
            self.by_name[r.name] = r.id
        self.retired = dict(hdr.retired)
        self.held = {
            tag: [tuple(flat[i : i + 3]) for i in range(0, len(flat), 3)] for tag, flat in hdr.held
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

    # ================================================================== internals

    def _replicas(self, o: Obj, host: str | None = None) -> list[ObjectReplica]:
        lim = self.config.slice_limit
        segs = self.segs
        if len(o.layout) == 12 and o.size <= lim:
            sid, off = SLICE.unpack(o.layout)
            s = segs[sid]
            return [ObjectReplica([ReplicaDesc(s.name, s.node_id, s.endpoint, off, o.size)])]
        lens = slice_lengths(o.size, lim)
        reps = []
        local = []
        for copy in unpack_layout(o.layout, len(lens)):
            sl = []
            on_host = False
            for (sid, off), ln in zip(copy, lens):
                s = segs[sid]
                sl.append(ReplicaDesc(s.name, s.node_id, s.endpoint, off, ln))
                on_host = on_host or (host is not None and s.host_id == host)
            (local if on_host else reps).append(ObjectReplica(sl))
        return local + reps

    def _bytes(self, o: Obj) -> int:
        lim = self.config.slice_limit
        a = self.config.align
        ns = n_slices(o.size, lim)
        copies = len(o.layout) // (12 * ns)
        per = sum((ln + a - 1) & -a for ln in slice_lengths(o.size, lim))
        return per * copies

    def _copies(self, o: Obj) -> tuple[list[list[tuple[int, int]]], list[int]]:
        lens = slice_lengths(o.size, self.config.slice_limit)
        return unpack_layout(o.layout, len(lens)), lens

    def _register(self, key: str, copies: list[list[tuple[int, int]]]) -> None:
        segs = self.segs
        for copy in copies:
            for sid, _ in copy:
                segs[sid].slices += 1

    def live_keys(self, s: _Seg) -> list[str]:
        """The keys with a slice in segment ``s``, each once, in table order."""
        names = self.objects.names
        return [names[r] for r in self.objects.rows_of(s.id)]  # type: ignore[misc]

    def _release_copies(self, key: str, o: Obj, hold_tag: int = 0) -> None:
        """Free (or hold under ``hold_tag``) every slice of ``o`` and unregister ``key``."""
        copies, lens = self._copies(o)
        segs = self.segs
        held = self.held.setdefault(hold_tag, []) if hold_tag else None
        for copy in copies:
            for (sid, off), ln in zip(copy, lens):
                s = segs[sid]
                s.slices -= 1
                if held is not None:
                    held.append((sid, off, ln))
                else:
                    s.alloc.free(off, ln)

    def _drop(self, key: str, event: Event, hold_tag: int = 0) -> bool:
        """Remove ``key`` through ``event`` if the lifecycle allows it; frees its bytes."""
        o = self.objects.get(key)
        if o is None:
            return False
        busy = key in self.processing
        if next_state(_P if busy else _C, event) is not State.GONE:
            return False
        del self.objects[key]
        if busy:
            del self.processing[key]
        else:
            self.complete -= 1
        self._release_copies(key, o, hold_tag)
        return True

    def _pick(
        self,
        n: int,
        exclude: set[str] | frozenset[str],
        prefer: set[str] | frozenset[str],
        cfg: ReplicateConfig,
        first: bool,
        draw: int,
        mounted: list[_Seg],
    ) -> _Seg | None:
        """The segment for one slice of ``n`` (aligned) bytes; see the module docstring."""
        if first and cfg.preferred_segment is not None:
            s = self.segs.get(self.by_name.get(cfg.preferred_segment, 0))
            if (
                s is not None
                and s.state == MOUNTED
                and s.node_id not in exclude
                and s.alloc.largest() >= n
            ):
                return s
        if exclude:
            cands = [s for s in mounted if s.node_id not in exclude and s.alloc.largest() >= n]
        else:
            cands = [s for s in mounted if s.alloc.largest() >= n]
        if not cands:
            return None
        if prefer:
            same = [s for s in cands if s.node_id in prefer]
            if same:
                cands = same
        strategy = cfg.strategy
        if strategy == "random":
            return cands[_mix(draw) % len(cands)]
        if strategy == "local" and cfg.writer_host is not None:
            loc = [s for s in cands if s.host_id == cfg.writer_host]
            if loc:
                cands = loc
        return cands[0] if len(cands) == 1 else max(cands, key=_free_bytes)

    def _place(
        self, size: int, cfg: ReplicateConfig, index: int, pos: int, mounted: list[_Seg]
    ) -> list[list[tuple[int, int]]] | None:
        a = self.config.align
        if cfg.replica_num == 1 and size <= self.config.slice_limit:  # the common case
            s = self._pick(
                (size + a - 1) & -a, _NONE, _NONE, cfg, True, (index << 24) ^ (pos << 12), mounted
            )
            return None if s is None else [[(s.id, s.alloc.alloc(size))]]
        lens = slice_lengths(size, self.config.slice_limit)
        used_nodes: set[str] = set()
        copies: list[list[tuple[int, int]]] = []
        done: list[tuple[_Seg, int, int]] = []
        for r in range(cfg.replica_num):
            nodes: set[str] = set()
            copy = []
            for j, ln in enumerate(lens):
                draw = (index << 24) ^ (pos << 12) ^ (r << 8) ^ j
                s = self._pick((ln + a - 1) & -a, used_nodes, nodes, cfg, r == 0, draw, mounted)
                off = -1 if s is None else s.alloc.alloc(ln)
                if s is None or off < 0:
                    for seg, o, length in reversed(done):
                        seg.alloc.free(o, length)
                    return None
                done.append((s, off, ln))
                copy.append((s.id, off))
                nodes.add(s.node_id)
            used_nodes |= nodes
            copies.append(copy)
        return copies

    def _drop_segment(self, seg: _Seg, now: float, tag: int) -> list[str]:
        """Unmount ``seg`` now: drop every copy with a slice in it; returns the COMPLETE keys
        left with no copy (removed; PROCESSING ones go silently, their PutEnd then fails).
        Bytes held in it vanish with it. The other slices of a dropped copy (in segments
        that stay) are held under ``tag``, not freed: a reader may hold a lease on them."""
        lost = []
        segs = self.segs
        held = self.held.setdefault(tag, [])
        for key in sorted(self.live_keys(seg)):
            o = self.objects[key]
            copies, lens = self._copies(o)
            keep = [c for c in copies if all(sid != seg.id for sid, _ in c)]
            if not keep:
                busy = key in self.processing
                if next_state(_P if busy else _C, Event.NODE_LOST) is State.GONE:
                    del self.objects[key]
                    if busy:
                        del self.processing[key]
                    else:
                        self.complete -= 1
                        lost.append(key)
            else:
                self.objects[key] = replace(o, layout=pack_layout(keep))
            for c in copies:
                if c in keep:
                    continue
                for (sid, off), ln in zip(c, lens):
                    segs[sid].slices -= 1
                    if sid != seg.id:
                        held.append((sid, off, ln))
        for t in list(self.held):
            rest = [e for e in self.held[t] if e[0] != seg.id]
            if rest:
                self.held[t] = rest
            else:
                del self.held[t]
        del segs[seg.id]
        del self.by_name[seg.name]
        self.retired[seg.name] = now
        return lost

    @staticmethod
    def _batch_ok(keys: list[str], *others: list[Any]) -> bool:
        n = len(keys)
        return n <= MAX_BATCH_KEYS and all(len(x) == n for x in others)

    # ================================================================== command handlers

    def _mount(self, index: int, c: Mount) -> Codes:
        if (
            key_error(c.node_id) is not None
            or key_error(c.segment) is not None
            or len(c.endpoint) > MAX_KEY_BYTES
            or len(c.host_id) > MAX_KEY_BYTES
            or not (self.config.align <= c.size <= MAX_OBJECT_SIZE)
        ):
            return Codes([int(Code.INVALID_PARAMS)])
        q = self.config.remount_quarantine
        for name in [n for n, t in self.retired.items() if c.now >= t + q]:
            del self.retired[name]
        if c.segment in self.by_name or c.segment in self.retired:
            return Codes([int(Code.SEGMENT_ALREADY_EXISTS)])
        if c.max_segments > 0 and len(self.segs) >= c.max_segments:
            return Codes([int(Code.NO_AVAILABLE_HANDLE)])  # the pool's segment cap
        sid = self.next_seg
        self.next_seg += 1
        alloc = SegmentAllocator(c.size, self.config.align)
        seg = _Seg(
            sid, c.segment, c.node_id, c.endpoint, c.host_id, c.size, alloc, MOUNTED, 0.0, index
        )
        self.segs[sid] = seg
        self.by_name[c.segment] = sid
        return Codes([0])

    def _unmount(self, index: int, c: Unmount) -> ExpireResult:
        sid = self.by_name.get(c.segment)
        seg = None if sid is None else self.segs[sid]
        if seg is None or seg.node_id != c.node_id:
            return ExpireResult([int(Code.SEGMENT_NOT_FOUND)], [])
        if c.grace > 0:
            if seg.state == MOUNTED:
                seg.state = DRAINING
                seg.deadline = c.now + c.grace
            return ExpireResult([0], [])
        return ExpireResult([0], self._drop_segment(seg, c.now, index))

    def _expire(self, index: int, c: ExpireNodes) -> ExpireResult:
        codes = []
        lost: list[str] = []
        for node in c.node_ids[:MAX_BATCH_KEYS]:
            mine = [s for s in self.segs.values() if s.node_id == node]
            if not mine:
                codes.append(int(Code.CLIENT_NOT_FOUND))
                continue
            for s in mine:
                lost.extend(self._drop_segment(s, c.now, index))
            codes.append(0)
        return ExpireResult(codes, lost)

    def _check_put(self, c: PutStart | Upsert) -> int:
        cfg = c.config
        if not self._batch_ok(c.keys, c.sizes):
            return int(Code.INVALID_PARAMS)
        if not (1 <= cfg.replica_num <= MAX_REPLICAS) or cfg.strategy not in _STRATEGIES:
            return int(Code.INVALID_PARAMS)
        lim = self.config.slice_limit
        sizes = c.sizes
        if sizes and set(map(type, sizes)) == {int} and min(sizes) > 0 and max(sizes) <= lim:
            work = len(sizes)  # one slice each (C-level passes instead of a loop)
        else:
            work = sum(-(-z // lim) for z in sizes if type(z) is int and 0 < z <= MAX_OBJECT_SIZE)
        if work * cfg.replica_num > MAX_SLICES_PER_BATCH:
            return int(Code.INVALID_PARAMS)  # bounded work per entry: split the batch
        return 0

    def _new_object(
        self, index: int, pos: int, size: int, c: PutStart | Upsert, mounted: list[_Seg]
    ) -> tuple[int, Obj | None, list]:
        """Allocate (not yet registered) copies; ``(code, record, copies)``."""
        copies = self._place(size, c.config, index, pos, mounted)
        if copies is None:
            return int(Code.NO_AVAILABLE_HANDLE), None, []
        pin, until = _pin_of(c.config, c.now, c.pin_ttl)
        return 0, Obj(size, _P, index, c.now, pack_layout(copies), pin, until), copies

    def _put_start(self, index: int, c: PutStart) -> PutStartResult | PutStartRun:
        return self._put(index, c, upsert=False)

    def _upsert(self, index: int, c: Upsert) -> PutStartResult:
        return self._put(index, c, upsert=True)

    def _put(self, index: int, c: PutStart | Upsert, upsert: bool) -> PutStartResult | PutStartRun:
        bad = self._check_put(c)
        n = len(c.keys)
        if bad:
            return PutStartResult([bad] * n, [None] * n, [0] * n)
        if not upsert:
            fast = self._put_start_batch(index, c)
            if fast is not None:
                return fast
        codes: list[int] = []
        reps: list[list[ObjectReplica] | None] = []
        vers: list[int] = []
        objs = self.objects
        mounted = [s for s in self.segs.values() if s.state == MOUNTED]
        for pos, (key, size) in enumerate(zip(c.keys, c.sizes)):
            code = 0
            o = None
            if (
                not (type(key) is str and 0 < len(key) <= 256 and key.isascii() and "\0" not in key)
                and key_error(key) is not None
            ):
                code = int(Code.INVALID_KEY)
            elif not 1 <= size <= MAX_OBJECT_SIZE:
                code = int(Code.INVALID_PARAMS)
            else:
                old = objs.get(key)
                if old is None:
                    if next_state(State.GONE, Event.PUT_START) is State.PROCESSING:
                        code, o, copies = self._new_object(index, pos, size, c, mounted)
                        if o is not None:
                            self._register(key, copies)
                            objs[key] = o
                            self.processing[key] = index
                elif key in self.processing:
                    code = int(Code.REPLICA_IS_NOT_READY)  # another put is in flight
                elif not upsert:
                    code = int(Code.OBJECT_ALREADY_EXISTS)
                elif (
                    old.size == size
                    and len(old.layout) // (12 * n_slices(size, self.config.slice_limit))
                    == c.config.replica_num
                    and all(
                        self.segs[sid].state == MOUNTED for sid, _ in SLICE.iter_unpack(old.layout)
                    )
                ):
                    # Same shape: rewrite in place (the service made sure no reader holds a lease).
                    pin, until = _pin_of(c.config, c.now, c.pin_ttl)
                    nxt = int(next_state(_C, Event.UPSERT_REUSE))  # type: ignore[arg-type]
                    o = replace(
                        old, state=nxt, version=index, started=c.now, pin=pin, pin_until=until
                    )
                    objs[key] = o
                    self.complete -= 1
                    self.processing[key] = index
                else:
                    # New allocation first, so a NoSpace leaves the old object intact.
                    code, o, copies = self._new_object(index, pos, size, c, mounted)
                    if o is not None:
                        self.complete -= 1
                        self._release_copies(key, old)
                        self._register(key, copies)
                        objs[key] = o  # PROCESSING: TRANSITIONS[(COMPLETE, UPSERT_REPLACE)]
                        self.processing[key] = index
            codes.append(code)
            if o is None:
                reps.append(None)
                vers.append(0)
            else:
                reps.append(self._replicas(o))
                vers.append(index)
        return PutStartResult(codes, reps, vers)

    def _put_start_batch(self, index: int, c: PutStart | Upsert) -> PutStartRun | None:
        """The common PutStart (one copy, one slice per key, no preferred segment, not
        ``random``) for a whole batch at once, with exactly the outcome of the per-key path
        in :meth:`_put` (None: not this case, nothing changed). Keys are classified first;
        the ones to allocate are cut into runs of equal (aligned) size; per run the segment
        of each key is chosen as :meth:`_pick` would, with per-segment free bytes and the
        count of pieces each segment can still take (:meth:`SegmentAllocator.capacity`)
        standing in for the allocator, and then each segment allocates its share with one
        :meth:`SegmentAllocator.alloc_run` (the same offsets as one ``alloc`` per key).
        The answer is the compact :class:`PutStartRun` (what the per-key path would answer,
        see :meth:`PutStartRun.expand`)."""
        cfg = c.config
        lim = self.config.slice_limit
        if cfg.replica_num != 1 or cfg.strategy == "random" or cfg.preferred_segment is not None:
            return None
        keys, sizes = c.keys, c.sizes
        n = len(keys)
        objs = self.objects
        codes = [0] * n
        todo: list[int] = []
        fresh: dict[str, int] = {}  # the batch's keys -> this version (distinct if len n)
        if (
            n
            and keys_valid(keys)
            and set(map(type, sizes)) == {int}
            and min(sizes) >= 1
            and max(sizes) <= min(lim, MAX_OBJECT_SIZE)
            and len(fresh := dict.fromkeys(keys, index)) == n
        ):
            # The batch a conforming client sends: every key valid and distinct, every size
            # one slice (checked with C-level passes); only the table decides per key.
            olds = list(map(objs.index.get, keys))
            if olds.count(None) == n:
                todo = list(range(n))
            else:
                proc = self.processing
                for pos, old in enumerate(olds):
                    if old is None:
                        todo.append(pos)
                    elif keys[pos] in proc:
                        codes[pos] = int(Code.REPLICA_IS_NOT_READY)  # a put is in flight
                    else:
                        codes[pos] = int(Code.OBJECT_ALREADY_EXISTS)
        else:
            seen: set[str] = set()
            for pos, (key, size) in enumerate(zip(keys, sizes)):
                if (
                    not (
                        type(key) is str
                        and 0 < len(key) <= 256
                        and key.isascii()
                        and "\0" not in key
                    )
                    and key_error(key) is not None
                ):
                    codes[pos] = int(Code.INVALID_KEY)
                elif not 1 <= size <= MAX_OBJECT_SIZE:
                    codes[pos] = int(Code.INVALID_PARAMS)
                elif size > lim or key in seen:
                    return None  # slices, or a key twice: the per-key path (nothing changed)
                else:
                    old = objs.index.get(key)
                    if old is None:
                        todo.append(pos)
                        seen.add(key)
                    elif key in self.processing:
                        codes[pos] = int(Code.REPLICA_IS_NOT_READY)  # a put is in flight
                    else:
                        codes[pos] = int(Code.OBJECT_ALREADY_EXISTS)
        if todo and next_state(State.GONE, Event.PUT_START) is not State.PROCESSING:
            return None
        where = [-1] * n
        offsets = [0] * n
        used: dict[int, int] = {}  # segment id -> its index in the result's segs
        used_segs: list[_Seg] = []
        a = self.config.align
        mounted = [s for s in self.segs.values() if s.state == MOUNTED]
        host = cfg.writer_host if cfg.strategy == "local" else None
        pin, until = _pin_of(cfg, c.now, c.pin_ttl)
        processing = self.processing
        no_space = int(Code.NO_AVAILABLE_HANDLE)
        now = c.now
        everyone = len(todo) == n  # todo is then 0..n-1
        if everyone and n and (min(sizes) + a - 1) & -a == (max(sizes) + a - 1) & -a:
            runs = [todo]  # one aligned size: one run (no per-key scan)
        else:
            runs = []
            lo = 0
            while lo < len(todo):
                rounded = (sizes[todo[lo]] + a - 1) & -a
                hi = lo + 1
                while hi < len(todo) and (sizes[todo[hi]] + a - 1) & -a == rounded:
                    hi += 1
                runs.append(todo[lo:hi])
                lo = hi
        for run in runs:
            rounded = (sizes[run[0]] + a - 1) & -a
            left = [s.alloc.capacity(rounded, len(run)) for s in mounted]
            free = [s.alloc.free_bytes for s in mounted]
            share: list[list[int]] = [[] for _ in mounted]  # run positions per segment
            i = 0
            while i < len(run):
                cands = [j for j in range(len(mounted)) if left[j] > 0]
                if host is not None:
                    loc = [j for j in cands if mounted[j].host_id == host]
                    if loc:
                        cands = loc
                if not cands:
                    for pos in run[i:]:
                        codes[pos] = no_space
                    break
                if len(cands) == 1:  # the rest of the run (or what fits) goes there
                    j = cands[0]
                    take = min(left[j], len(run) - i)
                else:
                    j = max(cands, key=free.__getitem__)  # first of the most free, as _pick
                    take = 1
                share[j].extend(run[i : i + take])
                left[j] -= take
                free[j] -= take * rounded
                i += take
            whole = None  # the one segment that took the whole run, if one did
            for j, mine in enumerate(share):
                if not mine:
                    continue
                s = mounted[j]
                w = used.get(s.id)
                if w is None:
                    w = used[s.id] = len(used_segs)
                    used_segs.append(s)
                offs = s.alloc.alloc_run(rounded, len(mine))
                s.slices += len(mine)
                if len(mine) == len(run):
                    whole = (s, w, offs)
                    break
                for pos, off in zip(mine, offs):
                    where[pos] = w
                    offsets[pos] = off
            # table order as in the per-key path (snapshots, digests)
            if whole is not None:
                s, w, offs = whole
                sid = s.id
                m = len(run)
                if m == n:
                    rkeys, rsizes = keys, sizes
                else:
                    rkeys = [keys[pos] for pos in run]
                    rsizes = [sizes[pos] for pos in run]
                # column writes for the run, not a record per key
                objs.put_run(rkeys, rsizes, index, now, sid, offs, pin, until)
                # the PROCESSING index gets the batch's keys -> version (built above when
                # they checked distinct, which a set would have cost as much)
                processing.update(
                    fresh if m == n and len(fresh) == n else dict.fromkeys(rkeys, index)
                )
                if len(run) == n:  # the whole batch
                    where, offsets = [w] * n, offs
                    continue
                for pos, off in zip(run, offs):
                    where[pos] = w
                    offsets[pos] = off
                continue
            # several segments: the placed keys of the run in key order (the table order
            # of the per-key path), one column write for them all
            placed = [pos for pos in run if where[pos] >= 0]
            if placed:
                pkeys = [keys[pos] for pos in placed]
                objs.put_run(
                    pkeys,
                    [sizes[pos] for pos in placed],
                    index,
                    now,
                    [used_segs[where[pos]].id for pos in placed],
                    [offsets[pos] for pos in placed],
                    pin,
                    until,
                )
                processing.update(dict.fromkeys(pkeys, index))
        return PutStartRun(
            codes,
            index,
            ReplicaRun(
                [(s.name, s.node_id, s.endpoint) for s in used_segs],
                where,
                offsets,
                list(sizes)
                if -1 not in where
                else [z if w >= 0 else 0 for z, w in zip(sizes, where)],
            ),
        )

    def _put_end(self, index: int, c: PutEnd) -> Codes:
        # versions are required: without them a late PutEnd could publish another
        # writer's half-written put of the key (after a reclaim and a new put)
        if not self._batch_ok(c.keys, c.versions):
            return Codes([int(Code.INVALID_PARAMS)] * len(c.keys))
        codes = []
        objs = self.objects
        processing = self.processing
        not_found, invalid = int(Code.OBJECT_NOT_FOUND), int(Code.INVALID_WRITE)
        # the lifecycle's answers, looked up once per batch: PROCESSING -> COMPLETE is
        # dropping the key from `processing` (the record stays as written)
        publish = next_state(_P, Event.PUT_END) is State.COMPLETE
        again = next_state(_C, Event.PUT_END) is State.COMPLETE
        get = processing.get
        # The usual batch: every key PROCESSING at its version (keys are ``str``, as
        # decoded). C-level passes: compare the versions as lists, pop them all (a key
        # named twice pops once; its second mention is a repeated PutEnd of a COMPLETE
        # version: 0 as well).
        if publish and again and list(map(get, c.keys)) == c.versions:
            popped = list(map(processing.pop, c.keys, repeat(None, len(c.keys))))
            self.complete += len(popped) - popped.count(None)
            return Codes([0] * len(c.keys))
        done = 0
        for key, version in zip(c.keys, c.versions):
            v = get(key) if type(key) is str else None
            if v is not None:  # PROCESSING, v its version: the small dict only
                if version != v or not publish:
                    codes.append(invalid)
                    continue
                del processing[key]
                done += 1
                codes.append(0)
                continue
            o = objs.get(key) if type(key) is str else None
            if o is None:
                codes.append(not_found)
            elif version != o.version or not again:
                codes.append(invalid)
            else:
                codes.append(0)  # COMPLETE already: a repeated PutEnd of its version
        self.complete += done
        return Codes(codes)

    def _put_revoke(self, index: int, c: PutRevoke) -> Codes:
        # versions are required: a revoke must never free bytes another writer is writing
        if not self._batch_ok(c.keys, c.versions):
            return Codes([int(Code.INVALID_PARAMS)] * len(c.keys))
        codes = []
        for i, key in enumerate(c.keys):
            o = self.objects.get(key) if type(key) is str else None
            if o is None:
                codes.append(int(Code.OBJECT_NOT_FOUND))
            elif c.versions[i] != o.version or not self._drop(key, Event.PUT_REVOKE):
                codes.append(int(Code.INVALID_WRITE))
            else:
                codes.append(0)
        return Codes(codes)

    def _remove(self, index: int, c: Remove) -> Codes:
        if not self._batch_ok(c.keys):
            return Codes([int(Code.INVALID_PARAMS)] * len(c.keys))
        codes = []
        tag = index if c.hold else 0
        for key in c.keys:
            o = self.objects.get(key) if type(key) is str else None
            if o is None:
                codes.append(int(Code.OBJECT_NOT_FOUND))
            elif not self._drop(key, Event.REMOVE, tag):
                codes.append(int(Code.REPLICA_IS_NOT_READY))
            else:
                codes.append(0)
        if tag and not self.held.get(tag):
            self.held.pop(tag, None)
        return Codes(codes)

    def _remove_all(self, index: int, c: RemoveAll) -> RemoveAllResult:
        skip = set(c.skip)
        tag = index if c.hold else 0
        n = 0
        for key in list(self.objects):
            if key not in skip and self._drop(key, Event.REMOVE, tag):
                n += 1
        if tag and not self.held.get(tag):
            self.held.pop(tag, None)
        return RemoveAllResult(n)

    def prefix_candidates(
        self,
        prefix: str,
        keys: Iterable[str],
        limit: int,
        leased: Callable[[str], bool] | None = None,
    ) -> tuple[list[str], int, bool]:
        """One slice of a leader's scan for a remove by prefix: the COMPLETE keys among
        ``keys`` that start with ``prefix``, at most ``limit``; how many it passed over
        because ``leased(key)``; whether it stopped at the limit. The leader feeds ``keys``
        in slices of :meth:`keys`, so a scan of a huge table never holds its loop long."""
        objs, proc = self.objects, self.processing
        out: list[str] = []
        skipped = 0
        for k in keys:
            if k.startswith(prefix):
                if k not in objs or k in proc:
                    continue
                if leased is not None and leased(k):
                    skipped += 1
                    continue
                if len(out) >= limit:
                    return out, skipped, True
                out.append(k)
        return out, skipped, False

    def _remove_prefix(self, index: int, c: RemovePrefix) -> RemovePrefixResult:
        if not self._batch_ok(c.keys):
            return RemovePrefixResult(0, c.skipped, c.more)
        tag = index if c.hold else 0
        removed = busy = 0
        objs = self.objects
        p = c.prefix
        for key in c.keys:
            o = objs.get(key) if type(key) is str else None
            if o is None or not key.startswith(p):
                continue  # gone since the leader's scan (or never matched): nothing to do
            if self._drop(key, Event.REMOVE, tag):
                removed += 1
            else:
                busy += 1  # PROCESSING again (re-put since the scan): its writer owns it
        if tag and not self.held.get(tag):
            self.held.pop(tag, None)
        return RemovePrefixResult(removed, c.skipped + busy, c.more)

    def _reclaim(self, index: int, c: Reclaim) -> ReclaimResult:
        cutoff = c.now - c.put_timeout
        objs = self.objects
        # (version, key) order: the same on a replica restored from a snapshot
        stale = sorted(
            (k for k in self.processing if objs[k].started < cutoff),
            key=lambda k: (objs[k].version, k),
        )
        for k in stale:
            self._drop(k, Event.RECLAIM)
        due = [s for s in self.segs.values() if s.state == DRAINING and s.deadline <= c.now]
        lost: list[str] = []
        for s in due:
            lost.extend(self._drop_segment(s, c.now, index))
        return ReclaimResult(stale, [s.name for s in due], lost)

    def _evict(self, index: int, c: Evict) -> EvictResult:
        if not self._batch_ok(c.keys) or (c.versions and len(c.versions) != len(c.keys)):
            return EvictResult([int(Code.INVALID_PARAMS)] * len(c.keys), 0)
        codes = []
        freed = 0
        for i, key in enumerate(c.keys):
            o = self.objects.get(key) if type(key) is str else None
            if o is None:
                codes.append(int(Code.OBJECT_NOT_FOUND))
                continue
            if (
                (c.versions and c.versions[i] != o.version)
                or o.pin == PIN_HARD
                or (o.pin == PIN_SOFT and o.pin_until > c.now and not c.allow_soft)
            ):
                codes.append(int(Code.NOT_EVICTABLE))
                continue
            nbytes = self._bytes(o)
            if not self._drop(key, Event.EVICT):
                codes.append(int(Code.NOT_EVICTABLE))
                continue
            freed += nbytes
            codes.append(0)
        return EvictResult(codes, freed)

    def _pin(self, index: int, c: Pin) -> Codes:
        if not self._batch_ok(c.keys):
            return Codes([int(Code.INVALID_PARAMS)] * len(c.keys))
        codes = []
        for key in c.keys:
            o = self.objects.get(key) if type(key) is str else None
            if o is None:
                codes.append(int(Code.OBJECT_NOT_FOUND))
                continue
            if c.hard:
                self.objects[key] = replace(o, pin=PIN_HARD, pin_until=0.0)
            elif o.pin != PIN_HARD:
                self.objects[key] = replace(
                    o, pin=PIN_SOFT, pin_until=max(o.pin_until, c.now + c.ttl)
                )
            codes.append(0)
        return Codes(codes)

    def _unpin(self, index: int, c: Unpin) -> Codes:
        if not self._batch_ok(c.keys):
            return Codes([int(Code.INVALID_PARAMS)] * len(c.keys))
        codes = []
        for key in c.keys:
            o = self.objects.get(key) if type(key) is str else None
            if o is None:
                codes.append(int(Code.OBJECT_NOT_FOUND))
                continue
            self.objects[key] = replace(o, pin=PIN_NONE, pin_until=0.0)
            codes.append(0)
        return Codes(codes)

    def _release(self, index: int, c: Release) -> Codes:
        codes = []
        for tag in c.tags[:MAX_BATCH_KEYS]:
            ext = self.held.pop(tag, None)
            if ext is None:
                codes.append(int(Code.OBJECT_NOT_FOUND))
                continue
            for sid, off, ln in ext:
                self.segs[sid].alloc.free(off, ln)
            codes.append(0)
        return Codes(codes)


def _free_bytes(s: _Seg) -> int:
    return s.alloc.free_bytes


def _pin_of(cfg: ReplicateConfig, now: float, ttl: float) -> tuple[int, float]:
    if cfg.hard_pin:
        return PIN_HARD, 0.0
    if cfg.soft_pin:
        return PIN_SOFT, now + ttl
    return PIN_NONE, 0.0
