"""The disk tier in the :class:`~.state.StoreStateMachine` (docs/store.md, "Disk tier"):
``DemoteStart`` / ``DemoteEnd`` / ``DemoteRevoke`` / ``DropReplica`` and the queries the
leader and the storage nodes need about it.

An object has at most one disk copy, always the *last* copy of its layout; ``Obj.tier`` says
whether it has one and in which state (``TIER_DEMOTING``: PROCESSING, being written by its
node, never returned by a lookup; ``TIER_DISK``: COMPLETE, its crc32c in ``Obj.crc``). Every
other copy is in memory. The life of a demotion::

    memory only --DemoteStart--> + disk PROCESSING --DemoteEnd(crc)--> + disk COMPLETE
         ^                             |                                     |
         +-------- DemoteRevoke -------+             DropReplica(memory) --> disk only

Promotion on hit is the way back: ``PromoteStart`` reserves a memory copy of a disk-only
object (a reservation, ``reserved[tag]``, as a writer's: no lookup sees it, ``Release``
frees it if the node never ends), the disk copy's node reads the disk copy into it and
checks the crc, and ``PromoteEnd`` makes it the object's memory copy, the disk copy kept
(the object is then as after a ``DemoteEnd``: on both media, its memory free to drop).

``DropReplica(memory)`` is refused unless the disk copy is COMPLETE: apply, not only the
leader, keeps the rule that a memory copy is never freed before its disk copy is durable.
The master moves no byte: the node owning the disk copy copies it (``node.py``) and ends it.
"""

from __future__ import annotations

import numpy as np
from msgspec.structs import replace

from ..errors import Code
from ..types import DemoteTask, ObjectReplica, ReplicaDesc
from .commands import (
    Codes,
    DemoteEnd,
    DemoteRevoke,
    DemoteStart,
    DropReplica,
    EvictResult,
    PromoteEnd,
    PromoteResult,
    PromoteStart,
)
from .objects import (
    PIN_HARD,
    PIN_SOFT,
    TIER_DEMOTING,
    TIER_DISK,
    TIER_NONE,
    Event,
    Obj,
    pack_layout,
    slice_lengths,
)
from .segments import DISK, MEMORY, MOUNTED, Segment
from .writes import carve_extent

__all__ = ["Tiers"]


class Tiers:
    """The disk-tier part of :class:`~.state.StoreStateMachine`."""

    # ------------------------------------------------------------------ queries

    def has_disk(self) -> bool:
        return any(s.medium == DISK for s in self.segs.values())

    def disk_free(self) -> int:
        return sum(
            s.alloc.free_bytes
            for s in self.segs.values()
            if s.medium == DISK and s.state == MOUNTED
        )

    def tier_of(self, key: str) -> int:
        r = self.objects.index.get(key)
        return TIER_NONE if r is None else self.objects.tier.item(r)

    def demoting(self) -> list[tuple[str, int]]:
        """``(key, version)`` of every demotion in flight, in table order (one pass over the
        tier column per applied entry: the leader's tick and every heartbeat ask)."""
        t = self.objects
        memo = getattr(self, "_demoting_memo", None)
        if memo is not None and memo[0] == self.applied and memo[1] is t:
            return memo[2]
        rows = np.flatnonzero(t.tier[: t.n] == TIER_DEMOTING).tolist()
        names, version = t.names, t.version
        out = [(names[r], version.item(r)) for r in rows]  # type: ignore[misc]
        self._demoting_memo = (self.applied, t, out)
        return out

    def no_memory_to_free(self) -> np.ndarray:
        """Row mask of objects with no memory copy (``evict_info(key, memory)`` is None for
        them): one-slice objects whose one copy is on disk. Eviction's and demotion's walk
        from the oldest skips them in one vectorised pass (``choose_victims``): else every
        decision walked past every disk-only object, the oldest ones, at a few us each
        (16,000 of them: 20 ms a batch). The other refusals (a demotion in flight, bounded
        by ``demote_inflight_bytes``) stay ``evict_info``'s alone."""
        t = self.objects
        n = t.n
        return (t.tier[:n] == TIER_DISK) & (t.sid[:n] != 0)

    def reclaimable_bytes(self) -> int:
        """About the memory bytes of objects that also have a COMPLETE disk copy (freed at
        once when memory is needed): one copy per object counted, a vectorised pass."""
        t = self.objects
        n = t.n
        both = (t.tier[:n] == TIER_DISK) & (t.sid[:n] == 0)  # several copies: memory + disk
        a = self.config.align
        return int((((t.size[:n][both] + a - 1) // a) * a).sum())

    def demoted_keys(self) -> list[str]:
        """Keys with a COMPLETE disk copy, in table order."""
        t = self.objects
        names = t.names
        return [names[r] for r in np.flatnonzero(t.tier[: t.n] == TIER_DISK).tolist()]  # type: ignore[misc]

    def disk_copy(self, key: str) -> list[tuple[str, int]]:
        """``(segment, offset)`` per slice of ``key``'s disk copy (empty: none)."""
        o = self.objects.get(key)
        if o is None or not o.tier:
            return []
        copies, _ = self._copies(o)
        return [(self.segs[sid].name, off) for sid, off in copies[-1]]

    def medium_bytes(self, o: Obj, medium: str) -> int:
        """Allocated bytes of ``o``'s copies on ``medium``."""
        copies, lens = self._copies(o)
        a = self.config.align
        per = sum((ln + a - 1) & -a for ln in lens)
        disk = 1 if o.tier else 0
        return per * (disk if medium == DISK else len(copies) - disk)

    def evict_info(self, key: str, medium: str | None = None) -> tuple[int, int, int, float] | None:
        """``(version, bytes, pin, pin_until)`` of a COMPLETE object (None: not COMPLETE).
        With ``medium``: the bytes it holds there, and None unless freeing that medium is
        possible now -- ``memory``: it has memory copies and no demotion in flight;
        ``disk``: its only copy is a COMPLETE disk copy."""
        o = self.objects.get(key)
        if o is None or key in self.processing:
            return None
        if medium is None:
            return o.version, self._bytes(o), o.pin, o.pin_until
        only_disk = o.tier == TIER_DISK and len(o.layout) // 12 == len(
            slice_lengths(o.size, self.config.slice_limit)
        )
        if medium == MEMORY:
            if o.tier == TIER_DEMOTING or only_disk:
                return None
        elif not only_disk:
            return None
        return o.version, self.medium_bytes(o, medium), o.pin, o.pin_until

    def demote_tasks(self, node_id: str, limit: int) -> list[DemoteTask]:
        """The demotions in flight whose disk copy is on ``node_id``'s disk (at most
        ``limit``), each with a memory copy to read (one on that node first)."""
        out: list[DemoteTask] = []
        segs = self.segs
        for key, version in self.demoting():
            if len(out) >= limit:
                break
            o = self.objects[key]
            copies, lens = self._copies(o)
            disk = copies[-1]
            if segs[disk[0][0]].node_id != node_id:
                continue
            mem = copies[:-1]
            if not mem:
                continue  # nothing to copy from (never, while memory waits for the disk)
            mem.sort(key=lambda c: segs[c[0][0]].node_id != node_id)
            out.append(
                DemoteTask(
                    key, version, o.size, self._replica(mem[0], lens), self._replica(disk, lens)
                )
            )
        return out

    def demoting_disk(self, key: str, version: int, node_id: str) -> list[int] | None:
        """The segment ids of ``key``'s PROCESSING disk copy at ``version`` when every slice
        of it is on ``node_id``'s segments -- a demotion that node may report failed --
        else None."""
        o = self.objects.get(key)
        if o is None or o.version != version or o.tier != TIER_DEMOTING:
            return None
        copies, _ = self._copies(o)
        sids = [sid for sid, _ in copies[-1]]
        segs = self.segs
        if any(segs[s].node_id != node_id for s in sids):
            return None
        return sids

    def _replica(self, copy: list[tuple[int, int]], lens: list[int]) -> ObjectReplica:
        segs = self.segs
        return ObjectReplica(
            [
                ReplicaDesc(segs[sid].name, segs[sid].node_id, segs[sid].endpoint, off, ln)
                for (sid, off), ln in zip(copy, lens)
            ]
        )

    # ------------------------------------------------------------------ handlers

    def _tier_batch_ok(self, keys: list[str], *others: list) -> bool:
        return self._batch_ok(keys, *others) and all(type(k) is str for k in keys)

    def _demote_start(self, index: int, c: DemoteStart) -> Codes:
        if not self._tier_batch_ok(c.keys, c.versions):
            return Codes([int(Code.INVALID_PARAMS)] * len(c.keys))
        codes = []
        for key, version in zip(c.keys, c.versions):
            o = self.objects.get(key)
            if o is None or key in self.processing:
                codes.append(int(Code.OBJECT_NOT_FOUND))
                continue
            if (
                version != o.version
                or o.tier != TIER_NONE
                or o.pin == PIN_HARD
                or (o.pin == PIN_SOFT and o.pin_until > c.now and not c.allow_soft)
            ):
                codes.append(int(Code.NOT_EVICTABLE))
                continue
            copies, lens = self._copies(o)
            disk = self._place_disk(lens, self.segs[copies[0][0][0]].node_id, c.avoid)
            if disk is None:
                codes.append(int(Code.NO_AVAILABLE_HANDLE))
                continue
            self.objects[key] = replace(o, layout=pack_layout([*copies, disk]), tier=TIER_DEMOTING)
            codes.append(0)
        return Codes(codes)

    def _place_disk(
        self, lens: list[int], node: str, avoid: list[int] | None = None
    ) -> list[tuple[int, int]] | None:
        """One disk copy of slices ``lens``: each slice on a mounted disk segment (none of
        ``avoid``), ``node``'s first, then the most free (deterministic: segment order
        breaks ties)."""
        a = self.config.align
        skip = set(avoid or ())
        disks = [
            s
            for s in self.segs.values()
            if s.medium == DISK and s.state == MOUNTED and s.id not in skip
        ]
        done: list[tuple[Segment, int, int]] = []
        for ln in lens:
            need = (ln + a - 1) & -a
            cands = [s for s in disks if s.alloc.largest() >= need]
            if not cands:
                for s, off, n in reversed(done):
                    s.alloc.free(off, n)
                    s.slices -= 1
                return None
            mine = [s for s in cands if s.node_id == node]
            s = mine[0] if mine else max(cands, key=lambda s: s.alloc.free_bytes)
            done.append((s, s.alloc.alloc(ln), ln))
            s.slices += 1
        return [(s.id, off) for s, off, _ in done]

    def _free_copy(self, copy: list[tuple[int, int]], lens: list[int]) -> int:
        a = self.config.align
        freed = 0
        for (sid, off), ln in zip(copy, lens):
            s = self.segs[sid]
            s.alloc.free(off, ln)
            s.slices -= 1
            freed += (ln + a - 1) & -a
        return freed

    def _demote_end(self, index: int, c: DemoteEnd) -> Codes:
        if not self._tier_batch_ok(c.keys, c.versions, c.crcs):
            return Codes([int(Code.INVALID_PARAMS)] * len(c.keys))
        codes = []
        segs = self.segs
        for key, version, crc in zip(c.keys, c.versions, c.crcs):
            o = self.objects.get(key)
            if o is None:
                codes.append(int(Code.OBJECT_NOT_FOUND))
                continue
            if version != o.version or not 0 <= crc < 1 << 32:
                codes.append(int(Code.INVALID_WRITE))
                continue
            if o.tier == TIER_DISK and o.crc == crc:
                codes.append(0)  # a repeated DemoteEnd
                continue
            copies, _ = self._copies(o)
            if o.tier != TIER_DEMOTING or any(
                segs[sid].node_id != c.node_id for sid, _ in copies[-1]
            ):
                codes.append(int(Code.INVALID_WRITE))
                continue
            self.objects[key] = replace(o, tier=TIER_DISK, crc=crc)
            codes.append(0)
        return Codes(codes)

    def _demote_revoke(self, index: int, c: DemoteRevoke) -> Codes:
        if not self._tier_batch_ok(c.keys, c.versions):
            return Codes([int(Code.INVALID_PARAMS)] * len(c.keys))
        codes = []
        for key, version in zip(c.keys, c.versions):
            o = self.objects.get(key)
            if o is None:
                codes.append(int(Code.OBJECT_NOT_FOUND))
                continue
            if version != o.version or o.tier != TIER_DEMOTING:
                codes.append(int(Code.INVALID_WRITE))
                continue
            copies, lens = self._copies(o)
            self._free_copy(copies[-1], lens)
            self.objects[key] = replace(o, layout=pack_layout(copies[:-1]), tier=TIER_NONE, crc=0)
            codes.append(0)
        return Codes(codes)

    def _drop_replica(self, index: int, c: DropReplica) -> EvictResult:
        if not self._tier_batch_ok(c.keys, c.versions) or c.medium not in (MEMORY, DISK):
            return EvictResult([int(Code.INVALID_PARAMS)] * len(c.keys), 0)
        codes = []
        freed = 0
        for key, version in zip(c.keys, c.versions):
            o = self.objects.get(key)
            if o is None or key in self.processing:
                codes.append(int(Code.OBJECT_NOT_FOUND))
                continue
            if version != o.version or o.tier != TIER_DISK:
                codes.append(int(Code.NOT_EVICTABLE))
                continue
            copies, lens = self._copies(o)
            if c.medium == DISK:
                if len(copies) == 1:  # its last copy: the object goes (Evict's lifecycle)
                    nbytes = self._bytes(o)
                    if not self._drop(key, Event.EVICT):
                        codes.append(int(Code.NOT_EVICTABLE))
                        continue
                    freed += nbytes
                else:
                    freed += self._free_copy(copies[-1], lens)
                    self.objects[key] = replace(
                        o, layout=pack_layout(copies[:-1]), tier=TIER_NONE, crc=0
                    )
                codes.append(0)
                continue
            if len(copies) == 1 or not self.offline_sids().isdisjoint(s for s, _ in copies[-1]):
                # no memory copy left, or the disk copy is offline (unreadable until adopted)
                codes.append(int(Code.NOT_EVICTABLE))
                continue
            for copy in copies[:-1]:
                freed += self._free_copy(copy, lens)
            self.objects[key] = replace(o, layout=pack_layout(copies[-1:]))
            codes.append(0)
        return EvictResult(codes, freed)

    # ------------------------------------------------------------------ promotion on hit

    def promotable(self, key: str) -> int:
        """The version of ``key`` if it is a disk-only COMPLETE single-slice object whose
        disk copy is online (what ``PromoteStart`` takes), else 0."""
        o = self.objects.get(key)
        if o is None or o.tier != TIER_DISK or key in self.processing:
            return 0
        copies, lens = self._copies(o)
        if len(copies) != 1 or len(lens) != 1 or copies[0][0][0] in self.offline_sids():
            return 0
        return o.version

    def _promote_start(self, index: int, c: PromoteStart) -> PromoteResult:
        n = len(c.keys)
        if not self._tier_batch_ok(c.keys, c.versions):
            return PromoteResult([int(Code.INVALID_PARAMS)] * n)
        a = self.config.align
        segs = self.segs
        codes, sids, offs = [], [], []
        ext: list[tuple[int, int, int]] = []
        for key, version in zip(c.keys, c.versions):
            v = self.promotable(key)
            if not v or v != version:
                codes.append(int(Code.OBJECT_NOT_FOUND if key not in self.objects else
                                 Code.NOT_EVICTABLE))  # fmt: skip
                sids.append(0)
                offs.append(0)
                continue
            o = self.objects[key]
            disk = self._copies(o)[0][0]
            node = segs[disk[0][0]].node_id
            need = (o.size + a - 1) & -a
            # the disk copy's node's memory: it copies locally, from its file to its memory
            s = next(
                (s for s in segs.values() if s.medium == MEMORY and s.state == MOUNTED
                 and s.node_id == node and s.alloc.largest() >= need),
                None,
            )  # fmt: skip
            if s is None:
                codes.append(int(Code.NO_AVAILABLE_HANDLE))
                sids.append(0)
                offs.append(0)
                continue
            off = s.alloc.alloc(need)
            ext.append((s.id, off, need))
            codes.append(0)
            sids.append(s.id)
            offs.append(off)
        if not ext:
            return PromoteResult(codes, 0, sids, offs)
        self.reserved[index] = ext
        return PromoteResult(codes, index, sids, offs)

    def _promote_end(self, index: int, c: PromoteEnd) -> Codes:
        n = len(c.keys)
        if not self._tier_batch_ok(c.keys, c.versions, c.segments, c.offsets) or not all(
            type(x) is str for x in c.segments
        ):
            return Codes([int(Code.INVALID_PARAMS)] * n)
        ext = self.reserved.get(c.tag)
        a = self.config.align
        codes = []
        for key, version, name, off in zip(c.keys, c.versions, c.segments, c.offsets):
            o = self.objects.get(key)
            if o is None:
                codes.append(int(Code.OBJECT_NOT_FOUND))
                continue
            sid = self.by_name.get(name)
            s = None if sid is None else self.segs.get(sid)
            if (
                ext is None
                or s is None
                or s.node_id != c.node_id
                or s.medium != MEMORY
                or s.state != MOUNTED
                or self.promotable(key) != version
                or off % a
                or not carve_extent(ext, s.id, off, (o.size + a - 1) & -a)
            ):
                codes.append(int(Code.INVALID_WRITE))
                continue
            disk = self._copies(o)[0][0]
            s.slices += 1
            # memory first, the disk copy last (as every object with a disk copy)
            self.objects[key] = replace(o, layout=pack_layout([[(s.id, off)], disk]))
            codes.append(0)
        if ext is not None and not ext:
            del self.reserved[c.tag]
        return Codes(codes)
