"""The master's object table, column-wise: one row per object, numpy columns per field.

A dict of Python records costs about 670 bytes per object (the record, its boxed ints and
floats, its layout ``bytes``, the segment key lists); at tens of millions of objects that is
the master's whole memory. Here an object is

* its key ``str`` and one entry in :attr:`Table.index` (key -> row, the lookup every query
  starts with): one dict up to :data:`SHARD_AT` keys, then an :class:`~.index.Index` of
  ``index.SHARDS`` dicts picked by the key's hash, so no dict resize rehashes more than one
  shard (a dict of millions of keys resizes in one step of half a second),
* a pointer in :attr:`Table.names` (row -> key, ``None`` for a free row),
* one row of the columns (:data:`COLUMNS`): size, version, started, pin, pin_until and the
  layout of the common object -- one copy of one slice -- as ``sid`` (u32) and ``off`` (u64).
  Objects of several slices or copies keep their packed layout (``objects.pack_layout``)
  in :attr:`Table.extra` and ``sid`` 0 (segment ids start at 1).

Past :data:`RESERVE_AT` rows the columns (and the free list) are views of address ranges
reserved once (``MAP_NORESERVE``: memory only for the pages written), so they grow by a
longer view and never by copying every column.

Freed rows go on a LIFO free list and are reused first. Row order is *table order*
(``keys()``): a function of the applied entries alone, restored exactly from a snapshot
(the image lists the free rows), so every replica iterates the same order.

The PROCESSING index (key -> version) stays a small dict owned by the state machine: the
table gets a reference only to answer ``state`` in its record view.

Snapshots (:meth:`Table.image`) are taken without a copy: the image registers itself, and
until it has encoded a row, the first change to that row saves the row's old contents for
it (copy-on-write per row, :meth:`_save`). Each ``next()`` encodes :data:`CHUNK_ROWS` rows
straight from the columns (a slice copy), so no step of a snapshot holds the caller longer
than one chunk's encoding, whatever the table's size.

The leader's access order for eviction is one more column, :attr:`Table.stamp` (u32, not
in :data:`COLUMNS`: soft state, never in snapshots or digests, 0 on followers and after a
restore): :meth:`touch` writes a clock value to the rows of the keys read or written, a new
row starts at 0 (the oldest), and :meth:`oldest_rows` yields live rows by (stamp, row) --
an approximate LRU (a batch shares one stamp) read with vectorised passes, no second dict
of every key.

The table is also a read-only ``Mapping[str, Obj]`` (tests, invariants): ``table[key]``
builds an :class:`~.objects.Obj` from the row.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import msgspec
import numpy as np

from .index import SHARD_AT, Index
from .objects import SLICE, Obj, State

__all__ = ["CHUNK_ROWS", "COLUMNS", "Rows", "Table"]

CHUNK_ROWS = 1 << 14  # ~8 ms of encoding a step (HiCache-shaped keys): the stall bound
COLUMNS: tuple[tuple[str, str], ...] = (
    ("size", "<i8"),  # 0: a free row
    ("version", "<i8"),
    ("started", "<f8"),
    ("pin", "u1"),
    ("pin_until", "<f8"),
    ("sid", "<u4"),  # 0: layout in Table.extra
    ("off", "<u8"),
    ("tier", "u1"),  # the disk tier's state of the row's last copy (objects.Obj.tier)
    ("crc", "<u4"),  # crc32c of a COMPLETE disk copy
)
_OLD_COLUMNS = 7  # images from before the disk tier: tier and crc 0
_NAMES = tuple(n for n, _ in COLUMNS)
_P, _C = int(State.PROCESSING), int(State.COMPLETE)

RESERVE_AT = 1 << 16  # rows: above, the columns live in a reserved address range
_MAP_NORESERVE = 0x4000  # Linux's value (the mmap module lacks the constant before 3.13)


def _untracked(names: list) -> list:
    """``names`` with the cyclic GC no longer scanning it: a full collection visits every
    item of a tracked list (reading each key's header), ~60 ms per 2 M keys and most of a
    second at 10 M, one stall of the loop each time. A list of ``str`` and ``None`` cannot
    be part of a cycle, and a list stays untracked as it grows (only a new list is
    tracked). ``PyObject_GC_UnTrack`` is public C API; without ctypes, the list stays
    tracked (correct, only slower to collect)."""
    if _UNTRACK is not None:
        _UNTRACK(names)
    return names


try:
    _UNTRACK = ctypes.pythonapi.PyObject_GC_UnTrack
    _UNTRACK.argtypes = (ctypes.py_object,)
    _UNTRACK.restype = None
except (AttributeError, OSError):  # pragma: no cover
    _UNTRACK = None  # type: ignore[assignment]


def _reserve(dt: str) -> np.ndarray | None:
    """A column of :func:`_reserve_rows` rows in an address range reserved, not committed
    (``MAP_NORESERVE``: pages become memory when first written), so a column never moves:
    it grows by a longer view of the same pages, no copy. None where the kernel refuses
    (strict overcommit, a small address space): the columns then grow by copying."""
    rows = _reserve_rows()
    if not rows:
        return None
    try:
        mm = mmap.mmap(
            -1,
            rows * np.dtype(dt).itemsize,
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
        )
    except (OSError, ValueError, OverflowError):
        return None
    return np.frombuffer(mm, dt)


def _reserve_rows() -> int:
    """Rows to reserve: more than this machine's memory could hold (an object costs
    >= 250 bytes, a row is reserved at 1 per 64 bytes of memory), at most 2**32."""
    global _RESERVE_ROWS
    if _RESERVE_ROWS < 0:
        _RESERVE_ROWS = 0
        try:
            with open("/proc/sys/vm/overcommit_memory") as f:
                strict = f.read().strip() == "2"
            phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (OSError, ValueError):
            return 0
        if not strict and sys.maxsize > 1 << 32:
            _RESERVE_ROWS = min(1 << 32, max(phys // 64, RESERVE_AT * 4))
    return _RESERVE_ROWS


_RESERVE_ROWS = -1


class Rows(msgspec.Struct, array_like=True, frozen=True):
    """One snapshot chunk: rows ``lo`` .. ``lo + len(keys)`` (``None``: a free row), each
    column as little-endian bytes in :data:`COLUMNS` order, and the packed layouts of the
    rows with ``sid`` 0."""

    lo: int
    keys: list[str | None]
    cols: list[bytes]
    extra: list[tuple[int, bytes]]


class _Image:
    """A snapshot in progress: rows below ``bound`` as they were when it was taken."""

    __slots__ = ("__weakref__", "bound", "cursor", "saved")

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.cursor = 0  # rows below it are encoded: their changes no longer matter
        self.saved: dict[int, tuple] = {}  # row -> its contents when the image was taken


class Table(Mapping[str, Obj]):
    def __init__(self, processing: dict[str, int]) -> None:
        self.index: dict[str, int] | Index = {}  # an Index once it passes SHARD_AT keys
        self.names: list[str | None] = _untracked([])
        self.extra: dict[int, bytes] = {}
        self.processing = processing
        self.n = 0  # rows ever used (live or free); row n is the next new one
        self.cap = 0
        for name, dt in COLUMNS:
            setattr(self, name, np.zeros(0, dt))
        self.free = np.zeros(0, np.int64)
        self.nfree = 0
        self.stamp = np.zeros(0, np.uint32)  # leader soft state (module docstring)
        self.clock = 1
        self._full: dict[str, np.ndarray] | None = None  # reserved columns (_grow)
        self._free_full: np.ndarray | None = None  # the free list's (_grow_free)
        self._images: weakref.WeakSet[_Image] = weakref.WeakSet()

    # ------------------------------------------------------------------ Mapping (views)

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: object) -> bool:
        return key in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.key_list())

    def __getitem__(self, key: str) -> Obj:
        return self.record(self.index[key], key)

    def get(self, key: Any, default: Any = None) -> Any:
        r = self.index.get(key) if type(key) is str else None
        return default if r is None else self.record(r, key)

    def record(self, r: int, key: str) -> Obj:
        """The row as an (immutable, detached) :class:`Obj`."""
        return Obj(
            self.size.item(r),
            _P if key in self.processing else _C,
            self.version.item(r),
            self.started.item(r),
            self.layout(r),
            self.pin.item(r),
            self.pin_until.item(r),
            self.tier.item(r),
            self.crc.item(r),
        )

    def layout(self, r: int) -> bytes:
        sid = self.sid.item(r)
        return SLICE.pack(sid, self.off.item(r)) if sid else self.extra[r]

    def key_list(self) -> list[str]:
        """Live keys in row order (keys are non-empty, free rows ``None``)."""
        return list(filter(None, self.names))

    def live_rows(self) -> np.ndarray:
        return np.flatnonzero(self.size[: self.n])

    # ------------------------------------------------------------------ changes

    def _grow(self, need: int) -> None:
        """Room for ``need`` rows. Past :data:`RESERVE_AT` rows the columns are views of
        reserved address ranges (:func:`_reserve`): growing is a longer view, nothing is
        copied, whatever the table's size (a copy of every column at 1.5x was ~410 MB at
        10 M rows, one stall of the loop). Below it, or where nothing could be reserved,
        the columns grow by half, copying the used part."""
        cap = max(1024, self.cap + (self.cap >> 1), need)
        if self._full is None and cap > RESERVE_AT:
            full = {name: _reserve(dt) for name, dt in (*COLUMNS, ("stamp", "<u4"))}
            if all(a is not None and len(a) >= cap for a in full.values()):
                self._full = full  # type: ignore[assignment]
                for name, a in full.items():
                    a[: self.n] = getattr(self, name)[: self.n]  # once, < RESERVE_AT rows
        full = self._full
        if full is not None and cap <= len(full["size"]):
            for name, a in full.items():
                setattr(self, name, a[:cap])
            self.cap = cap
            return
        for name, dt in COLUMNS:
            new = np.zeros(cap, dt)
            new[: self.n] = getattr(self, name)[: self.n]
            setattr(self, name, new)
        stamp = np.zeros(cap, np.uint32)
        stamp[: self.n] = self.stamp[: self.n]
        self.stamp = stamp
        self.cap = cap
        self._full = None

    def _index_grown(self) -> None:
        """The one dict passed :data:`SHARD_AT` keys: from now on an :class:`Index` (one
        pass over at most ``SHARD_AT`` keys, then bounded resizes only)."""
        ix = self.index
        self.index = Index.build(list(ix), list(ix.values()))

    def rows_get(self, keys: list[str]) -> list[int | None]:
        """Per key its row, None where absent (``map(index.get, keys)`` of either index)."""
        ix = self.index
        return list(map(ix.get, keys)) if type(ix) is dict else ix.get_many(keys)

    def has_none(self, keys: Iterable[str]) -> bool:
        """Whether no key of ``keys`` has a row (one C-level pass for the one dict)."""
        ix = self.index
        if type(ix) is dict:
            return ix.keys().isdisjoint(keys)
        return ix.has_none(keys if type(keys) is list else list(keys))

    def has_many(self, keys: list[str], flags: bool = False) -> list[Any]:
        """Per (``str``) key whether it has a row (``flags``: as 1 / 0, the wire's)."""
        ix = self.index
        if type(ix) is dict:
            if flags:
                return [1 if k in ix else 0 for k in keys]
            return [k in ix for k in keys]
        return ix.has_many(keys, flags)

    def _alloc(self, m: int) -> np.ndarray:
        """``m`` rows: the most recently freed first, then new ones."""
        k = min(m, self.nfree)
        top = self.nfree
        reused = self.free[top - k : top][::-1]
        self.nfree = top - k
        if k == m:
            return reused.copy()
        lo = self.n
        if lo + m - k > self.cap:
            self._grow(lo + m - k)
        self.n = lo + m - k
        return np.concatenate((reused, np.arange(lo, self.n, dtype=np.int64)))

    def _save(self, r: int) -> None:
        """Copy-on-write for the snapshots in progress: row ``r`` is about to change."""
        for im in self._images:
            if im.cursor <= r < im.bound and r not in im.saved:
                im.saved[r] = self._contents(r)

    def _save_rows(self, rows: np.ndarray) -> None:
        for im in self._images:
            hit = rows[(rows >= im.cursor) & (rows < im.bound)]
            for r in hit.tolist():
                if r not in im.saved:
                    im.saved[r] = self._contents(r)

    def _contents(self, r: int) -> tuple:
        return (
            self.names[r],
            *(getattr(self, name).item(r) for name in _NAMES),
            self.extra.get(r),
        )

    def _set_names(self, rows: list[int], keys: list[str]) -> None:
        names = self.names
        top = len(names)
        for r, k in zip(rows, keys):
            if r == top:
                names.append(k)
                top += 1
            else:
                names[r] = k

    def put(self, key: str, o: Obj) -> None:
        """Write ``key``'s record (a new row if the key is new)."""
        r = self.index.get(key)
        if r is None:
            r = int(self._alloc(1)[0])
            if self._images:
                self._save(r)
            self.index[key] = r
            if type(self.index) is dict and len(self.index) > SHARD_AT:
                self._index_grown()
            self._set_names([r], [key])
            self.stamp[r] = 0
        elif self._images:
            self._save(r)
        self.size[r] = o.size
        self.version[r] = o.version
        self.started[r] = o.started
        self.pin[r] = o.pin
        self.pin_until[r] = o.pin_until
        self.tier[r] = o.tier
        self.crc[r] = o.crc
        lay = o.layout
        if len(lay) == 12:
            sid, off = SLICE.unpack(lay)
            self.sid[r] = sid
            self.off[r] = off
            self.extra.pop(r, None)
        else:
            self.sid[r] = 0
            self.off[r] = 0
            self.extra[r] = lay

    __setitem__ = put

    def put_run(
        self,
        keys: list[str],
        sizes: list[int],
        version: int,
        started: float,
        sid: int,
        offs: list[int],
        pin: int,
        pin_until: float,
    ) -> None:
        """New rows for distinct new ``keys``, one copy of one slice each, all in segment
        ``sid`` (the batch PutStart): column writes instead of a record per key."""
        m = len(keys)
        rows = self._alloc(m)
        if self._images:
            self._save_rows(rows)
        first = int(rows[0]) if m else 0
        if m and first == len(self.names) == self.n - m:  # all new: slices, no gather
            sl: Any = slice(first, first + m)
            self.names.extend(keys)
            self.index.update(zip(keys, range(first, first + m)))
        else:
            sl = rows
            rl = rows.tolist()
            self._set_names(rl, keys)
            self.index.update(zip(keys, rl))
        if type(self.index) is dict and len(self.index) > SHARD_AT:
            self._index_grown()
        self.size[sl] = sizes
        self.version[sl] = version
        self.started[sl] = started
        self.pin[sl] = pin
        self.pin_until[sl] = pin_until
        self.sid[sl] = sid
        self.off[sl] = offs
        self.stamp[sl] = 0
        if self.extra:
            for r in rows.tolist():
                self.extra.pop(r, None)

    def drop(self, key: str) -> None:
        r = self.index.pop(key)
        if self._images:
            self._save(r)
        self.names[r] = None
        self.size[r] = 0
        self.sid[r] = 0
        self.tier[r] = 0  # a reused row (put_run) starts without a disk copy
        self.crc[r] = 0
        self.extra.pop(r, None)
        if self.nfree == len(self.free):
            self._grow_free()
        self.free[self.nfree] = r
        self.nfree += 1

    __delitem__ = drop

    def _grow_free(self, need: int = 0) -> None:
        """The free list doubles; past :data:`RESERVE_AT` entries it is a view of a
        reserved range like the columns (no copy of a list of millions of rows)."""
        top = self.nfree
        cap = max(1024, 2 * top, need)
        if self._free_full is None and cap > RESERVE_AT:
            a = _reserve("<i8")
            if a is not None and len(a) >= cap:
                a[:top] = self.free[:top]  # once, <= RESERVE_AT rows
                self._free_full = a
        a = self._free_full
        if a is not None and cap <= len(a):
            self.free = a[:cap]
        else:
            self.free = np.concatenate((self.free[:top], np.zeros(cap - top, np.int64)))
            self._free_full = None

    # ------------------------------------------------------------------ access order

    def touch(self, keys: Iterable[str]) -> None:
        """Keys read or written now: the youngest (keys not in the table are ignored)."""
        if self.clock >= 0xFFFFFFFF:
            self._renumber()
        if type(keys) is list and len(keys) == 1:  # a single get: no array built
            r = self.index.get(keys[0])
            if r is not None:
                self.stamp[r] = self.clock
                self.clock += 1
            return
        rows = self.rows_get(keys if type(keys) is list else list(keys))
        if None in rows:
            rows = [r for r in rows if r is not None]
        if not rows:
            return
        self.stamp[rows] = self.clock
        self.clock += 1

    def _renumber(self) -> None:
        """The clock ran out: the same order in the fewest stamps (ranks)."""
        u, inv = np.unique(self.stamp[: self.n], return_inverse=True)
        self.stamp[: self.n] = inv.astype(np.uint32)
        self.clock = len(u) + 1

    def reset_stamps(self) -> None:
        """Every object equally old (a new leader knows no accesses)."""
        self.stamp[: self.n] = 0
        self.clock = 1

    def oldest_rows(self, first: int = 4096, skip: np.ndarray | None = None) -> Iterator[int]:
        """Live rows from the least recently touched, ties in row order. Lazily: each
        pass picks the next ``first`` (doubling) rows with one ``argpartition`` over the
        rows, so a caller that stops early pays O(rows), not a full sort. Changes made
        while iterating may or may not be seen (an approximate order). ``skip``: a mask
        over the first ``n`` rows of rows left out (vectorised, before any row is yielded)."""
        n = self.n
        live = np.flatnonzero(self.size[:n] if skip is None else (self.size[:n] != 0) & ~skip)
        if not len(live):
            return
        order = (self.stamp[live].astype(np.uint64) << np.uint64(32)) | live.astype(np.uint64)
        done, k = 0, first
        while done < len(order):
            k = min(k, len(order))
            part = order if k == len(order) else order[np.argpartition(order, k - 1)[:k]]
            part.sort()
            for r in (part[done:] & np.uint64(0xFFFFFFFF)).tolist():
                if self.size[r]:
                    yield r
            done, k = k, k * 4

    # ------------------------------------------------------------------ queries

    def rows_of(self, sid: int) -> list[int]:
        """Rows with a slice in segment ``sid``, in row order."""
        n = self.n
        rows = np.flatnonzero(self.sid[:n] == sid).tolist()
        if self.extra:
            more = [
                r
                for r, lay in self.extra.items()
                if any(s == sid for s, _ in SLICE.iter_unpack(lay))
            ]
            if more:
                rows = sorted(rows + more)
        return rows

    def slice_counts(self) -> dict[int, int]:
        """Segment id -> slices placed there (every copy of every slice)."""
        counts = np.bincount(self.sid[: self.n])  # segment ids are small: no sort
        counts[:1] = 0  # sid 0: free rows and the rows in extra
        u = np.flatnonzero(counts)
        out = dict(zip(u.tolist(), counts[u].tolist()))
        for lay in self.extra.values():
            for s, _ in SLICE.iter_unpack(lay):
                out[s] = out.get(s, 0) + 1
        return out

    def nbytes(self) -> dict[str, int]:
        """Bytes the table holds, as allocated, by part: ``columns`` (and the free list),
        ``names`` (row -> key list), ``index`` (the key -> row dict and its row ints),
        ``keys`` (the key strings), ``extra`` (packed layouts of multi-slice objects).
        From ``sys.getsizeof``: the same on every machine for one Python build."""
        index = self.index
        big = max(0, len(index) - 257)  # rows above 256 are ints of their own
        ix_b = sys.getsizeof(index) if type(index) is dict else index.nbytes()
        return {
            "columns": sum(getattr(self, name).nbytes for name in _NAMES)
            + self.free.nbytes
            + self.stamp.nbytes,
            "names": sys.getsizeof(self.names),
            "index": ix_b + big * sys.getsizeof(1 << 20),
            "keys": sum(map(sys.getsizeof, index)),
            "extra": sys.getsizeof(self.extra)
            + sum(sys.getsizeof(v) + sys.getsizeof(1 << 20) for v in self.extra.values()),
        }

    # ------------------------------------------------------------------ snapshots

    def image(self) -> tuple[int, np.ndarray, Iterator[bytes]]:
        """The rows as they are now: ``(row count, free rows, chunks)``, the chunks
        (encoded :class:`Rows`) made lazily, one per ``next()``, unaffected by later
        changes (see the module docstring). The free rows are copied now (a memcpy)."""
        im = _Image(self.n)
        self._images.add(im)
        free = self.free[: self.nfree].copy()
        return self.n, free, self._chunks(im)

    def _chunks(self, im: _Image) -> Iterator[bytes]:
        enc = msgspec.msgpack.Encoder()
        try:
            for lo in range(0, im.bound, CHUNK_ROWS):
                hi = min(lo + CHUNK_ROWS, im.bound)
                keys = self.names[lo:hi]
                cols = [getattr(self, name)[lo:hi].copy() for name in _NAMES]
                size, sid = cols[0], cols[_NAMES.index("sid")]
                xs = (np.flatnonzero((sid == 0) & (size != 0)) + lo).tolist()
                extra = {r: self.extra[r] for r in xs}
                for r in [r for r in im.saved if r < hi]:
                    old = im.saved.pop(r)
                    keys[r - lo] = old[0]
                    for c, v in zip(cols, old[1:-1]):
                        c[r - lo] = v
                    extra.pop(r, None)
                    if old[-1] is not None:
                        extra[r] = old[-1]
                im.cursor = hi
                out = enc.encode(Rows(lo, keys, [c.tobytes() for c in cols], sorted(extra.items())))
                yield out
        finally:
            self._images.discard(im)

    def load_rows(self, n: int, free: np.ndarray, chunks: Iterable[Rows]) -> int:
        """Fill an empty table from an image (:meth:`image`); returns the live rows.
        ``ValueError``: the chunks do not add up to that image."""
        if n < 0:
            raise ValueError("negative row count")
        self._grow(n)
        self.n = n
        names: list[str | None] = []
        for ch in chunks:
            lo, m = ch.lo, len(ch.keys)
            if lo != len(names) or lo + m > n or len(ch.cols) not in (len(COLUMNS), _OLD_COLUMNS):
                raise ValueError(f"rows chunk at {lo} of {m} rows, expected {len(names)}")
            for (name, dt), raw in zip(COLUMNS, ch.cols):  # older images: fewer, zeros after
                getattr(self, name)[lo : lo + m] = np.frombuffer(raw, dt, m)
            names.extend(ch.keys)
            for r, lay in ch.extra:
                if not lo <= r < lo + m or len(lay) % 12 or not lay:
                    raise ValueError(f"bad layout of row {r}")
                self.extra[r] = lay
        if len(names) != n:
            raise ValueError(f"{len(names)} rows, image says {n}")
        self.names = _untracked(names)
        live = n - names.count(None)
        size, sid = self.size[:n], self.sid[:n]
        # Live rows only, in C-level passes (no per-row Python): a None key, even popped
        # again, would leave the dict in its general mode, slower to probe than a dict of
        # str keys only. The checks below prove the None names are exactly the free rows,
        # so the live keys pair with the nonzero sizes in order.
        index: dict[str, int] | Index
        if live > SHARD_AT:
            lk = names if live == n else list(filter(None, names))
            index = Index.build(lk, np.flatnonzero(size))  # type: ignore[arg-type]
        elif live == n:
            index = dict(zip(names, range(n)))
        else:
            index = dict(zip(filter(None, names), np.flatnonzero(size).tolist()))
        if (
            len(index) != live
            or int(np.count_nonzero(size)) != live
            or len(free) != n - live
            or len(np.unique(free)) != len(free)
            or (len(free) and (int(free.min()) < 0 or int(free.max()) >= n))
            or np.count_nonzero(size[free])
            or any(names[r] is not None for r in free.tolist())
            or int(np.count_nonzero((sid == 0) & (size != 0))) != len(self.extra)
            or any(not size[r] for r in self.extra)
        ):
            raise ValueError("rows, keys and free rows disagree")
        self.index = index
        self.nfree = 0
        self._grow_free(len(free))
        self.free[: len(free)] = free
        self.nfree = len(free)
        return live

    def load_records(self, keys: list[str], objs: list[Obj]) -> None:
        """Fill an empty table from records (the images of snapshot formats 1 and 2)."""
        for k, o in zip(keys, objs):
            self.put(k, o)
