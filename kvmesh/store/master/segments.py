"""The mounted segments: one :class:`Segment` each (its allocator, its state, its live
slice count), and the :class:`~.state.StoreStateMachine` part that keeps them -- the
``Mount`` / ``Unmount`` / ``ExpireNodes`` handlers, dropping a segment with the copies in it,
the slice bookkeeping of objects' copies, and the segment queries (:meth:`Segments.segments`,
:meth:`Segments.nodes`, :meth:`Segments.usage`).

A segment is ``mounted`` (placement may use it) or ``draining`` (an unmount with a grace: no
new slices; ``Reclaim`` drops it at its deadline) or, for a disk segment with a disk id whose
node expired or restarted, ``offline`` (docs/store.md, "Restart re-adoption"): its COMPLETE
copies stay listed but are never returned by a lookup nor counted by ``exists``, until its
node mounts the same disk id again and ``Adopt`` brings it back, or ``Reclaim`` drops it at
its deadline. A dropped segment's name is quarantined
for ``MasterConfig.remount_quarantine`` seconds of entry time.
"""

from __future__ import annotations

from msgspec.structs import replace

from ..errors import Code
from ..types import MAX_BATCH_KEYS, MAX_KEY_BYTES, MAX_OBJECT_SIZE, SegmentInfo, Usage, key_error
from .allocator import SegmentAllocator
from .commands import Adopt, Codes, ExpireNodes, ExpireResult, Mount, Unmount
from .objects import (
    TIER_DEMOTING,
    TIER_DISK,
    TIER_NONE,
    Event,
    Obj,
    State,
    n_slices,
    next_state,
    pack_layout,
    slice_lengths,
    unpack_layout,
)

__all__ = ["DISK", "DRAINING", "MEDIA", "MEMORY", "MOUNTED", "OFFLINE", "Segment", "Segments"]

MOUNTED, DRAINING, OFFLINE = "mounted", "draining", "offline"
MEMORY, DISK = "memory", "disk"
MEDIA = (MEMORY, DISK)
_P, _C = int(State.PROCESSING), int(State.COMPLETE)


class Segment:
    __slots__ = (
        "alloc",
        "deadline",
        "disk_id",
        "endpoint",
        "generation",
        "host_id",
        "id",
        "medium",
        "name",
        "node_id",
        "size",
        "slices",
        "state",
    )  # fmt: skip

    def __init__(self, sid: int, name: str, node_id: str, endpoint: str, host_id: str,
                 size: int, alloc: SegmentAllocator, state: str, deadline: float,
                 generation: int, medium: str = MEMORY, disk_id: str = "") -> None:  # fmt: skip
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
        self.medium = medium
        self.disk_id = disk_id  # a disk segment's identity across restarts ("": none)
        # (the keys placed here are the table's rows with this segment id: Table.rows_of)
        self.slices = 0  # slices of live objects placed here

    def info(self) -> SegmentInfo:
        return SegmentInfo(
            name=self.name, node_id=self.node_id, endpoint=self.endpoint, host_id=self.host_id,
            size=self.size, used=self.alloc.used, objects=self.slices, state=self.state,
            generation=self.generation, drain_deadline=self.deadline, medium=self.medium,
        )  # fmt: skip


class Segments:
    """The segment bookkeeping of :class:`~.state.StoreStateMachine`."""

    def segments(self) -> list[SegmentInfo]:
        return [s.info() for s in self.segs.values()]

    def nodes(self) -> dict[str, list[str]]:
        """node id -> names of its segments (mounted or draining)."""
        out: dict[str, list[str]] = {}
        for s in self.segs.values():
            out.setdefault(s.node_id, []).append(s.name)
        return out

    def usage(self, medium: str | None = MEMORY) -> Usage:
        """Totals of the segments of ``medium`` (None: all): capacity, used, segments, held
        and reserved bytes; object counts are of the whole pool. Memory by default: what
        puts are placed in and evicted from."""
        segs = self.segs
        mine = [s for s in segs.values() if medium is None or s.medium == medium]
        ids = {s.id for s in mine}
        a = self.config.align
        held = sum((ln + a - 1) & -a for v in self.held.values() for sid, _, ln in v if sid in ids)
        reserved = sum(ln for v in self.reserved.values() for sid, _, ln in v if sid in ids)
        return Usage(
            capacity=sum(s.alloc.size for s in mine), used=sum(s.alloc.used for s in mine),
            objects=len(self.objects), complete=self.complete, processing=len(self.processing),
            segments=len(mine), held_bytes=held, reserved_bytes=reserved,
        )  # fmt: skip

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

    def live_keys(self, s: Segment) -> list[str]:
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

    def _drop_segment(self, seg: Segment, now: float, tag: int) -> list[str]:
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
            tier, crc = o.tier, o.crc
            if tier:  # the last copy is on disk (objects.Obj.tier)
                if copies[-1] not in keep:
                    tier, crc = TIER_NONE, 0  # the disk copy went
                elif tier == TIER_DEMOTING and len(keep) == 1:
                    keep = []  # only a half-written disk copy left: the object is lost
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
                self.objects[key] = replace(o, layout=pack_layout(keep), tier=tier, crc=crc)
            for c in copies:
                if c in keep:
                    continue
                for (sid, off), ln in zip(c, lens):
                    segs[sid].slices -= 1
                    if sid != seg.id:
                        held.append((sid, off, ln))
        for tags in (self.held, self.reserved):
            for t in list(tags):
                rest = [e for e in tags[t] if e[0] != seg.id]
                if rest:
                    tags[t] = rest
                else:
                    del tags[t]
        del segs[seg.id]
        del self.by_name[seg.name]
        self._offline_memo = None
        self.retired[seg.name] = now
        return lost

    def _mount(self, index: int, c: Mount) -> Codes:
        if (
            key_error(c.node_id) is not None
            or key_error(c.segment) is not None
            or len(c.endpoint) > MAX_KEY_BYTES
            or len(c.host_id) > MAX_KEY_BYTES
            or not (self.config.align <= c.size <= MAX_OBJECT_SIZE)
            or c.medium not in MEDIA
        ):
            return Codes([int(Code.INVALID_PARAMS)])
        q = self.config.remount_quarantine
        for name in [n for n, t in self.retired.items() if c.now >= t + q]:
            del self.retired[name]
        if c.medium == DISK and c.disk_id:
            if len(c.disk_id) > MAX_KEY_BYTES:
                return Codes([int(Code.INVALID_PARAMS)])
            same = next((s for s in self.segs.values() if s.disk_id == c.disk_id), None)
            if same is not None and same.size == c.size and same.medium == DISK:
                return self._reattach(index, same, c)
            if same is not None:  # the same disk at another size: its copies are not trusted
                self._drop_segment(same, c.now, index)
                self.retired.pop(same.name, None)
            old = self.by_name.get(c.segment)
            if old is not None and self.segs[old].state == OFFLINE:
                # another disk (or a wiped id file) at this name: it adopts nothing
                self._drop_segment(self.segs[old], c.now, index)
                self.retired.pop(c.segment, None)
        if c.segment in self.by_name or c.segment in self.retired:
            return Codes([int(Code.SEGMENT_ALREADY_EXISTS)])
        if c.max_segments > 0 and len(self.segs) >= c.max_segments:
            return Codes([int(Code.NO_AVAILABLE_HANDLE)])  # the pool's segment cap
        sid = self.next_seg
        self.next_seg += 1
        alloc = SegmentAllocator(c.size, self.config.align)
        seg = Segment(
            sid, c.segment, c.node_id, c.endpoint, c.host_id, c.size, alloc, MOUNTED, 0.0, index,
            c.medium, c.disk_id if c.medium == DISK else "",
        )  # fmt: skip
        self.segs[sid] = seg
        self.by_name[c.segment] = sid
        return Codes([0])

    def _reattach(self, index: int, seg: Segment, c: Mount) -> Codes:
        """A node mounts the disk id of ``seg`` again (a restart; docs/store.md, "Restart
        re-adoption"): ``seg`` takes the new node's name and endpoint and stays offline (its
        copies unreadable) until that node's ``Adopt`` says which of them it verified."""
        other = self.by_name.get(c.segment)
        if (other is not None and other != seg.id) or (
            c.segment != seg.name and c.segment in self.retired
        ):
            return Codes([int(Code.SEGMENT_ALREADY_EXISTS)])
        if seg.state != OFFLINE:  # restarted before its old node expired
            self._go_offline(seg)
        del self.by_name[seg.name]
        if c.segment != seg.name:
            self.retired[seg.name] = c.now
        seg.name, seg.node_id, seg.endpoint, seg.host_id = (
            c.segment, c.node_id, c.endpoint, c.host_id,
        )  # fmt: skip
        seg.generation = index
        seg.deadline = c.now + (c.offline_ttl or self.config.remount_quarantine)
        self.by_name[c.segment] = seg.id
        return Codes([0])

    def _go_offline(self, seg: Segment) -> None:
        """Disk segment ``seg`` lost its node: its PROCESSING disk copies go (their memory
        copies stay), its COMPLETE ones stay listed, unreadable, until ``Adopt`` or
        ``Reclaim`` at the deadline the caller sets."""
        for key in sorted(self.live_keys(seg)):
            o = self.objects[key]
            copies, lens = self._copies(o)
            if o.tier != TIER_DEMOTING or all(sid != seg.id for sid, _ in copies[-1]):
                continue
            if len(copies) == 1:  # a half-written copy alone (never: memory waits for it)
                self._drop(key, Event.NODE_LOST)  # type: ignore[attr-defined]
                continue
            self._free_copy(copies[-1], lens)  # type: ignore[attr-defined]
            self.objects[key] = replace(o, layout=pack_layout(copies[:-1]), tier=TIER_NONE, crc=0)
        seg.state = OFFLINE
        self._offline_memo = None

    def offline_sids(self) -> set[int]:
        """Ids of the offline segments (their copies are never returned by lookups)."""
        memo = getattr(self, "_offline_memo", None)
        if memo is not None and memo[0] == self.applied and memo[1] is self.segs:
            return memo[2]
        out = {sid for sid, s in self.segs.items() if s.state == OFFLINE}
        self._offline_memo = (self.applied, self.segs, out)
        return out

    def adoptable(self, node_id: str, segment: str) -> list[tuple[str, int, int, int, int]] | None:
        """The copies offline disk segment ``segment`` of ``node_id`` still lists, for the
        node to verify: ``(key, version, offset, length, crc)`` of each object whose disk
        copy is one slice in it (others are dropped by ``Adopt``); None when ``segment`` is
        not an offline disk segment of that node."""
        sid = self.by_name.get(segment)
        seg = None if sid is None else self.segs[sid]
        if seg is None or seg.node_id != node_id or seg.state != OFFLINE:
            return None
        out = []
        for key in self.live_keys(seg):
            o = self.objects[key]
            copies, lens = self._copies(o)
            disk = copies[-1]
            if o.tier == TIER_DISK and len(disk) == 1 and disk[0][0] == seg.id:
                out.append((key, o.version, disk[0][1], lens[0], o.crc))
        return out

    def _adopt(self, index: int, c: Adopt) -> Codes:
        sid = self.by_name.get(c.segment)
        seg = None if sid is None else self.segs[sid]
        if seg is None or seg.node_id != c.node_id or seg.disk_id != c.disk_id:
            return Codes([int(Code.SEGMENT_NOT_FOUND)])
        if not self._batch_ok(c.keys, c.versions):  # type: ignore[attr-defined]
            return Codes([int(Code.INVALID_PARAMS)])
        if seg.state != OFFLINE:
            return Codes([0])  # a repeated Adopt
        bad = {k: v for k, v in zip(c.keys, c.versions) if type(k) is str}
        for key in sorted(self.live_keys(seg)):
            o = self.objects[key]
            copies, lens = self._copies(o)
            disk = copies[-1]
            whole = o.tier == TIER_DISK and len(disk) == 1 and disk[0][0] == seg.id
            if whole and bad.get(key) != o.version:
                continue
            if len(copies) == 1:  # its last copy: the object goes
                self._drop(key, Event.NODE_LOST)  # type: ignore[attr-defined]
                continue
            self._free_copy(disk, lens)  # type: ignore[attr-defined]
            self.objects[key] = replace(o, layout=pack_layout(copies[:-1]), tier=TIER_NONE, crc=0)
        seg.state = MOUNTED
        seg.deadline = 0.0
        self._offline_memo = None
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
            mine = [s for s in self.segs.values() if s.node_id == node and s.state != OFFLINE]
            if not mine:
                codes.append(int(Code.CLIENT_NOT_FOUND))
                continue
            # a disk with an id only goes offline (with c.disk_offline_ttl; 0: dropped, as
            # entries from before re-adoption were), after the memory: an object whose
            # memory went with a PROCESSING disk copy left is lost first
            keep = [s for s in mine if s.medium == DISK and s.disk_id and c.disk_offline_ttl > 0]
            for s in mine:
                if s not in keep:
                    lost.extend(self._drop_segment(s, c.now, index))
            for s in keep:
                self._go_offline(s)
                s.deadline = c.now + c.disk_offline_ttl
            codes.append(0)
        return ExpireResult(codes, lost)
