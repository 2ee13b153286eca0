"""The read-only queries of :class:`~.state.StoreStateMachine`: they serve the service
without a log entry (the service must have confirmed leadership -- read index or lease --
first) and change nothing. ``lookup_table`` is the read hot path: column gathers for the
common batch (``_lookup_simple``), a short path for one key (``_lookup_one``), a loop per key
for the rest; every form charges the same per-slice reply budget (``_seg_cost``).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from ..errors import Code
from ..types import ROW, LookupTable, ObjectLookup, replica_lists
from .objects import SLICE, TIER_DISK, Obj, State, slice_lengths, unpack_layout
from .segments import Segment

__all__ = ["Queries"]

_DESC_BYTES = 24  # msgpack framing and the two ints of one encoded ReplicaDesc (upper bound)


_SIMPLE_MIN = 16  # below this many keys numpy's per-call costs exceed the loop's per-key ones
_SLICE_DTYPE = np.dtype([("sid", "<u4"), ("off", "<u8")])  # SLICE ("<IQ") as numpy reads it
assert _SLICE_DTYPE.itemsize == SLICE.size


def _seg_cost(s: Segment) -> int:
    """Reply-budget charge of one slice in segment ``s``: the larger of its encodings, a
    ReplicaDesc (names included) or a table row (``ROW`` int64), so both reply forms stay
    within the budget."""
    return max(_DESC_BYTES + len(s.name) + len(s.node_id) + len(s.endpoint), 8 * ROW)


class Queries:
    """The read-only queries of :class:`~.state.StoreStateMachine`."""

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
        gone = self.offline_sids()  # type: ignore[attr-defined]
        if gone:
            pass  # copies in offline segments are skipped: the loop below
        elif len(keys) >= _SIMPLE_MIN:
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
        named: list[Segment] = []
        costs: list[int] = []  # budget charge of one slice in named[x]
        objs = self.objects
        segs = self.segs
        lim = self.config.slice_limit
        unpack = SLICE.unpack
        not_found, refused = int(Code.OBJECT_NOT_FOUND), int(Code.INVALID_PARAMS)
        proc = self.processing
        spent = 0
        crcs: list[int] = []  # filled from the first key with a disk copy on
        for i, k in enumerate(keys):
            o = objs.get(k) if type(k) is str else None
            if o is None or k in proc or (gone and self._hidden(gone, k)):
                codes.append(not_found)
                sizes.append(0)
                versions.append(0)
                continue
            if max_bytes is not None and spent >= max_bytes:
                codes.append(refused)
                sizes.append(0)
                versions.append(0)
                continue
            if o.tier == TIER_DISK or crcs:
                crcs += [-1] * (i - len(crcs))
                crcs.append(o.crc if o.tier == TIER_DISK else -1)
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
        if crcs:
            crcs += [-1] * (len(keys) - len(crcs))
            crcs = [c if code == 0 else -1 for c, code in zip(crcs, codes)]
        return LookupTable(
            codes,
            sizes,
            versions,
            [(s.name, s.node_id, s.endpoint) for s in named],
            np.frombuffer(rows, np.int64).reshape(-1, ROW),  # 'q' is int64 in native order
            crcs,
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
            [t.crc.item(r)] if t.tier.item(r) == TIER_DISK else [],
        )

    def _lookup_simple(self, keys: list[str], max_bytes: int | None) -> LookupTable | None:
        """:meth:`lookup_table` of the common batch -- every key a COMPLETE object of one
        copy in one slice, within the reply budget -- with column gathers instead of a
        Python loop per key; None when the batch is anything else (the loop answers it)."""
        if not keys or set(map(type, keys)) != {str}:
            return None
        t = self.objects
        got = t.rows_get(keys)
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
        disk = t.tier[at] == TIER_DISK  # one copy each: disk-only objects
        crcs = np.where(disk, t.crc[at].astype(np.int64), -1).tolist() if disk.any() else []
        return LookupTable(
            [0] * n,
            size.tolist(),
            t.version[at].tolist(),
            [(s.name, s.node_id, s.endpoint) for s in named],
            rows,
            crcs,
        )

    def _rows(
        self,
        i: int,
        o: Obj,
        host: str | None,
        index: dict[int, int],
        named: list[Segment],
        costs: list[int],
    ) -> tuple[list[int], int]:
        """:meth:`lookup_table`'s rows of object ``o`` (key index ``i``) and their cost."""
        lens = slice_lengths(o.size, self.config.slice_limit)
        segs = self.segs
        near: list[list[int]] = []
        far: list[list[int]] = []
        cost = 0
        copies = unpack_layout(o.layout, len(lens))
        disk: list[list[int]] = []
        on_disk = -1  # the index in ``copies`` of a readable disk copy
        if o.tier:  # the last copy is on disk: never while PROCESSING, else after memory
            last = copies.pop()
            if o.tier == TIER_DISK:
                copies.append(last)
                on_disk = len(copies) - 1
        gone = self.offline_sids()  # type: ignore[attr-defined]
        for c_no, copy in enumerate(copies):
            if gone and not gone.isdisjoint(sid for sid, _ in copy):
                continue  # in an offline segment: unreadable until adopted
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
            if c_no == on_disk:
                disk.append(cur)
            else:
                (near if on_host else far).append(cur)
        out: list[int] = []
        for c, cur in enumerate(near + far + disk):
            cur[1::ROW] = [c] * (len(cur) // ROW)
            out += cur
        return out, cost

    def _hidden(self, off: set[int], k: str) -> bool:
        """True when every copy of listed object ``k`` is in an offline segment (``off``):
        it is not found and not counted as present until its disk is adopted again."""
        t = self.objects
        r = t.index.get(k)
        if r is None:
            return False
        sid = t.sid.item(r)
        if sid:
            return sid in off
        copies, _ = self._copies(t.record(r, k))  # type: ignore[attr-defined]
        return all(not off.isdisjoint(s for s, _ in c) for c in copies)

    def _unhide(self, keys: list[str], flags: list[Any]) -> list[Any]:
        """``flags`` with the objects hidden by offline segments counted absent."""
        off = self.offline_sids()  # type: ignore[attr-defined]
        if not off:
            return flags
        return [f and type(k) is str and not self._hidden(off, k) for k, f in zip(keys, flags)]

    def exists(self, keys: Iterable[str]) -> list[bool]:
        """COMPLETE objects only, with a copy to read (none only in offline segments)."""
        ks = keys if type(keys) is list else list(keys)
        if self.offline_sids():  # type: ignore[attr-defined]
            return [bool(f) for f in self._unhide(ks, self._exists(ks))]
        return self._exists(ks)

    def _exists(self, ks: list[str]) -> list[bool]:
        objs, proc = self.objects.index, self.processing
        if set(map(type, ks)) <= {str}:  # what the service decodes: no per-key type test
            if not proc:
                return self.objects.has_many(ks)
            return [k in objs and k not in proc for k in ks]
        return [type(k) is str and k in objs and k not in proc for k in ks]

    def exists_flags(self, keys: list[str]) -> list[int]:
        """:meth:`exists` as the wire's 1 / 0 per key, for keys the caller checked are all
        ``str`` (the service's decoded requests): one pass, no type test per batch and no
        second pass from bools to ints."""
        objs, proc = self.objects.index, self.processing
        if self.offline_sids():  # type: ignore[attr-defined]
            return [int(f) for f in self.exists(keys)]
        if not proc:
            return self.objects.has_many(keys, True)
        return [1 if k in objs and k not in proc else 0 for k in keys]

    def exists_codes(self, prefix: str, keys: list[str], suffixes: list[str]) -> list[int]:
        """Per name ``prefix + key + suffix`` (key-major, every suffix): 1 for a COMPLETE
        object, else 0. The names are built and looked up in one pass (no list of names,
        no per-key type test: the service checked the parts, all ``str``)."""
        objs, proc = self.objects.index, self.processing
        if self.offline_sids():  # type: ignore[attr-defined]
            names = [f"{prefix}{k}{s}" for k in keys for s in suffixes]
            return [int(f) for f in self.exists(names)]
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
        if self.offline_sids():  # type: ignore[attr-defined]
            flags = self.exists_codes(prefix, keys, suffixes)
            n = len(suffixes)
            for i in range(len(keys)):
                if not all(flags[i * n : (i + 1) * n]):
                    return i
            return len(keys)
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
        """Log indices of hold removes whose bytes are not yet released, and of writers'
        reservations (released the same way: once nothing may write into them)."""
        return [*self.held, *self.reserved]

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
