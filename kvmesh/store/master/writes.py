"""The :class:`~.state.StoreStateMachine` part that writes object records: the put
protocol's handlers (``PutStart``, ``Upsert``, ``PutEnd``, ``PutRevoke``), the one-round-trip
put into a writer's reservation (``PutCommit``) and the pins (``Pin``, ``Unpin``). Where new
copies go is :mod:`.placement`'s.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np
from msgspec.structs import replace

from ..errors import Code
from ..types import (
    MAX_OBJECT_SIZE,
    MAX_REPLICAS,
    MAX_SLICES_PER_BATCH,
    ObjectReplica,
    ReplicaDesc,
    key_error,
    keys_valid,
)
from .commands import (
    Codes,
    Pin,
    PutCommit,
    PutCommitResult,
    PutEnd,
    PutRevoke,
    PutStart,
    PutStartResult,
    PutStartRun,
    Unpin,
    Upsert,
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
    pin_of,
    slice_lengths,
    unpack_layout,
)
from .segments import MEMORY, MOUNTED, Segment

__all__ = ["Writes"]

_P, _C = int(State.PROCESSING), int(State.COMPLETE)
_STRATEGIES = ("local", "random", "most_free")
_NONE: frozenset[str] = frozenset()
RESERVE_SHARE = 4  # writers' reservations hold at most 1/RESERVE_SHARE of memory, together


def _join(ext: list[tuple[int, int, int]], sid: int, off: int, n: int) -> None:
    """Add ``[off, off + n)`` of segment ``sid`` to a reservation's extents, kept sorted and
    coalesced (the writer keeps the same normal form: a batch it lays out inside one of
    its extents is inside one here)."""
    ext.append((sid, off, n))
    ext.sort()
    out: list[tuple[int, int, int]] = []
    for e in ext:
        if out and out[-1][0] == e[0] and out[-1][1] + out[-1][2] == e[1]:
            out[-1] = (e[0], out[-1][1], out[-1][2] + e[2])
        else:
            out.append(e)
    ext[:] = out


def carve_extent(ext: list[tuple[int, int, int]], sid: int, off: int, n: int) -> bool:
    """Take ``[off, off + n)`` of segment ``sid`` out of the unused extents ``ext`` of a
    reservation (``(sid, start, length)``); False (nothing changed) unless one extent
    holds all of it."""
    end = off + n
    for j, (s, start, ln) in enumerate(ext):
        if s == sid and start <= off and end <= start + ln:
            rest = []
            if off > start:
                rest.append((sid, start, off - start))
            if start + ln > end:
                rest.append((sid, end, start + ln - end))
            ext[j : j + 1] = rest
            return True
    return False


def _end_to_end(sizes: list[int], offs: list[int], a: int) -> int:
    """The bytes ``[offs[0], offs[0] + span)`` that the extents of a batch cover when they
    lie end to end from an aligned ``offs[0]`` (each rounded up to the alignment ``a``), every
    offset in ``[0, 2^62)``; 0 for any other layout (the per-key path judges it). Equal sizes
    (the usual batch) are compared as lists, in C; numpy only for mixed sizes."""
    n = len(sizes)
    if not n or len(offs) != n:
        return 0
    base = offs[0]
    if type(base) is not int or base < 0 or base % a:
        return 0
    s0 = sizes[0]
    if type(s0) is int and s0 >= 1 and sizes.count(s0) == n:
        step = (s0 + a - 1) & -a
        span = step * n
        if offs != list(range(base, base + span, step)):
            return 0
    else:
        r = (np.asarray(sizes, np.int64) + (a - 1)) & -a
        ends = np.cumsum(r) + base
        if n > 1 and not np.array_equal(np.asarray(offs[1:], np.int64), ends[:-1]):
            return 0
        span = int(ends[-1]) - base
    return span if base + span <= 1 << 62 else 0


class Writes:
    """The record-writing handlers of :class:`~.state.StoreStateMachine`."""

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
        self, index: int, pos: int, size: int, c: PutStart | Upsert, mounted: list[Segment]
    ) -> tuple[int, Obj | None, list]:
        """Allocate (not yet registered) copies; ``(code, record, copies)``."""
        copies = self._place(size, c.config, index, pos, mounted)
        if copies is None:
            return int(Code.NO_AVAILABLE_HANDLE), None, []
        pin, until = pin_of(c.config, c.now, c.pin_ttl)
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
        mounted = [s for s in self.segs.values() if s.state == MOUNTED and s.medium == MEMORY]
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
                        self.segs[sid].state == MOUNTED and self.segs[sid].medium == MEMORY
                        for sid, _ in SLICE.iter_unpack(old.layout)
                    )
                ):
                    # Same shape: rewrite in place (the service made sure no reader holds a lease).
                    pin, until = pin_of(c.config, c.now, c.pin_ttl)
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

    def _put_commit(self, index: int, c: PutCommit) -> PutCommitResult:
        """The one-round-trip put (docs/store-master.md, "Reservations"): the keys become
        COMPLETE objects at the extents their writer chose inside its reservation ``tag``
        (:attr:`reserved`), each checked against this replica's own state -- inside one unused
        extent of the reservation, aligned, in a mounted segment, the key new -- then the
        reservation is released or grown. A refused key leaves its extent reserved."""
        n = len(c.keys)
        cfg = c.config
        held = self.reserved
        tag = c.tag if c.tag and c.tag in held else 0
        if not self._batch_ok(c.keys, c.sizes, c.offsets) or cfg.replica_num != 1:
            codes = [int(Code.INVALID_PARAMS)] * n
        elif not n:
            codes = []
        else:
            seg = self.segs.get(c.sid)
            lifecycle = next_state(State.GONE, Event.PUT_COMMIT) is State.COMPLETE
            if (
                not tag
                or seg is None
                or seg.state != MOUNTED
                or seg.medium != MEMORY
                or not lifecycle
            ):
                codes = [int(Code.INVALID_WRITE)] * n
            else:
                codes = self._commit_keys(index, c, held[tag], seg)
        if tag and (c.release or not held[tag]):
            for sid, off, ln in held.pop(tag):
                self.segs[sid].alloc.free(off, ln)
            tag = 0
        added: list[int] = []
        where = None
        a = self.config.align
        if 0 < c.reserve <= MAX_OBJECT_SIZE:
            r = (c.reserve + a - 1) & -a
            # memory only, as every put: disk gets bytes by demotion, with a checksum
            mounted = [s for s in self.segs.values() if s.state == MOUNTED and s.medium == MEMORY]
            # Reserved bytes are neither objects nor evictable: all writers together hold at
            # most RESERVE_SHARE of memory, so idle reservations (writers that stopped, or
            # many writers) cannot crowd out the cache; past it, puts take two round trips.
            room = sum(s.size for s in mounted) // RESERVE_SHARE
            over = sum(ln for v in held.values() for _, _, ln in v) + r > room
            s = None if over else self._pick(r, _NONE, _NONE, cfg, True, index << 24, mounted)
            if s is not None:
                off = s.alloc.alloc(r)
                tag = tag or index
                _join(held.setdefault(tag, []), s.id, off, r)
                added = [s.id, off, r]
                where = (s.name, s.node_id, s.endpoint)
        return PutCommitResult(codes, tag, added, where)

    def _commit_keys(
        self, index: int, c: PutCommit, ext: list[tuple[int, int, int]], seg: Segment
    ) -> list[int]:
        keys, sizes, offs = c.keys, c.sizes, c.offsets
        n = len(keys)
        a = self.config.align
        top = min(self.config.slice_limit, MAX_OBJECT_SIZE)
        objs = self.objects
        sid = seg.id
        pin, until = pin_of(c.config, c.now, c.pin_ttl)
        span = _end_to_end(sizes, offs, a)
        if (
            span
            and keys_valid(keys)
            and min(sizes) >= 1
            and max(sizes) <= top
            and len(distinct := dict.fromkeys(keys)) == n
            and objs.has_none(distinct)
            and carve_extent(ext, sid, offs[0], span)
        ):
            # The batch a conforming client sends: new distinct keys laid end to end (each
            # rounded up to the alignment) in one extent: one carve and one column write.
            objs.put_run(keys, sizes, index, c.now, sid, offs, pin, until)
            seg.slices += n
            self.complete += n
            return [0] * n
        codes = []
        for key, size, off in zip(keys, sizes, offs):
            if key_error(key) is not None:
                codes.append(int(Code.INVALID_KEY))
            elif not 1 <= size <= top:
                codes.append(int(Code.INVALID_PARAMS))
            elif key in objs:
                busy = key in self.processing
                codes.append(int(Code.REPLICA_IS_NOT_READY if busy else Code.OBJECT_ALREADY_EXISTS))
            elif off % a or not carve_extent(ext, sid, off, (size + a - 1) & -a):
                codes.append(int(Code.INVALID_WRITE))  # not unused bytes of the reservation
            else:
                objs.put(key, Obj(size, _C, index, c.now, SLICE.pack(sid, off), pin, until))
                seg.slices += 1
                self.complete += 1
                codes.append(0)
        return codes

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
