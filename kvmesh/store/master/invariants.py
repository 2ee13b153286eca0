"""Whole-state consistency checks of a :class:`StoreStateMachine`, recomputed from scratch.

:func:`check` returns a list of violations (empty when all hold):

* every slice of every object, every held extent and every reserved one lies inside its
  segment, aligned;
* no two of them overlap (live copies never share bytes);
* the allocator's free extents are disjoint, fully coalesced, consistent across its three
  indexes, disjoint from every allocated extent, and allocated + free = segment size
  (accounting balances);
* the memory copies of one object are on pairwise distinct nodes, and each copy's slices
  cover the object's size exactly; a disk copy (``Obj.tier``: the last one) is on disk
  segments, every other copy on memory segments (no overlap per medium: per segment);
* the derived indexes (keys per segment, slice counts, PROCESSING set, COMPLETE count) match
  the object table.

The simulator runs it after every step; tests run it after every command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .allocator import SHIFT
from .objects import SLICE, TIER_DEMOTING, TIER_DISK, State, n_slices, slice_lengths

if TYPE_CHECKING:
    from .state import StoreStateMachine

__all__ = ["check", "extents"]


def extents(sm: StoreStateMachine) -> dict[int, list[tuple[int, int, str]]]:
    """Segment id -> allocated ``(start, end, owner)`` extents (owner: key or ``held:<tag>``),
    sorted by start."""
    a = sm.config.align
    lim = sm.config.slice_limit
    out: dict[int, list[tuple[int, int, str]]] = {sid: [] for sid in sm.segs}
    for key, o in sm.objects.items():
        lens = slice_lengths(o.size, lim)
        ns = len(lens)
        for i, (sid, off) in enumerate(SLICE.iter_unpack(o.layout)):
            ln = (lens[i % ns] + a - 1) & -a
            out.setdefault(sid, []).append((off, off + ln, key))
    for tag, ext in sm.held.items():
        for sid, off, ln in ext:
            out.setdefault(sid, []).append((off, off + ((ln + a - 1) & -a), f"held:{tag}"))
    for tag, ext in sm.reserved.items():
        for sid, off, ln in ext:
            out.setdefault(sid, []).append((off, off + ln, f"reserved:{tag}"))
    for v in out.values():
        v.sort()
    return out


def check(sm: StoreStateMachine) -> list[str]:
    errs: list[str] = []
    lim = sm.config.slice_limit
    a = sm.config.align
    segs = sm.segs
    ext = extents(sm)
    for sid in ext:
        if sid not in segs:
            errs.append(f"extents in unknown segment id {sid}")
    # -- objects ----------------------------------------------------------------------
    keys_in: dict[int, set[str]] = {sid: set() for sid in segs}
    slices_in: dict[int, int] = dict.fromkeys(segs, 0)
    # The PROCESSING index is the state (a key of the table not in it is COMPLETE): every
    # entry names a key of the table with that record's version, and the counts add up.
    objs = sm.objects
    for key, v in sm.processing.items():
        o = objs.get(key)
        if o is None:
            errs.append(f"PROCESSING index names {key!r}, not in the table")
        elif o.version != v:
            errs.append(f"{key!r}: PROCESSING index version {v}, record {o.version}")
    complete = len(objs) - sum(1 for k in sm.processing if k in objs)
    for key, o in objs.items():
        if o.state not in (State.COMPLETE, State.PROCESSING):
            errs.append(f"{key!r}: bad state {o.state}")
        ns = n_slices(o.size, lim)
        if not o.layout or len(o.layout) % (12 * ns):
            errs.append(f"{key!r}: layout of {len(o.layout)} bytes for {ns} slices")
            continue
        flat = list(SLICE.iter_unpack(o.layout))
        nodes_seen: set[str] = set()
        if o.tier and o.tier not in (TIER_DEMOTING, TIER_DISK):
            errs.append(f"{key!r}: bad tier {o.tier}")
        if o.tier and key in sm.processing:
            errs.append(f"{key!r}: a disk copy of a PROCESSING object")
        if o.tier == TIER_DEMOTING and len(o.layout) <= 12 * ns:
            # the disk copy is not durable yet: the object must still have a memory copy
            errs.append(f"{key!r}: only a PROCESSING disk copy left (memory freed too early)")
        for r in range(0, len(flat), ns):
            copy_nodes = set()
            disk = bool(o.tier) and r == len(flat) - ns  # the last copy, when it has one
            for sid, _off in flat[r : r + ns]:
                s = segs.get(sid)
                if s is None:
                    errs.append(f"{key!r}: slice in unmounted segment id {sid}")
                    continue
                if (s.medium == "disk") != disk:
                    errs.append(f"{key!r}: a {'disk' if disk else 'memory'} copy on {s.medium}")
                copy_nodes.add(s.node_id)
                keys_in[sid].add(key)
                slices_in[sid] += 1
            if disk:
                continue  # per medium: the disk copy may share the memory copy's node
            if copy_nodes & nodes_seen:
                errs.append(f"{key!r}: two copies share node(s) {sorted(copy_nodes & nodes_seen)}")
            nodes_seen |= copy_nodes
    if complete != sm.complete:
        errs.append(f"COMPLETE count {sm.complete}, table has {complete}")
    # -- segments ---------------------------------------------------------------------
    for sid, s in segs.items():
        al = s.alloc
        live = sm.live_keys(s)
        if len(live) != len(set(live)) or set(live) != keys_in[sid]:
            off = sorted(set(live) ^ keys_in[sid])[:5]
            errs.append(f"segment {s.name}: key index off by {off}")
        if s.slices != slices_in[sid]:
            errs.append(f"segment {s.name}: slice count {s.slices}, table has {slices_in[sid]}")
        used = ext.get(sid, [])
        prev_end = 0
        prev_owner = ""
        for start, end, owner in used:
            if start % a or start < 0 or end > al.size:
                errs.append(f"segment {s.name}: extent [{start},{end}) of {owner!r} misplaced")
            if start < prev_end:
                errs.append(
                    f"segment {s.name}: [{start},{end}) of {owner!r} overlaps {prev_owner!r}"
                    f" (ends {prev_end})"
                )
            if end > prev_end:
                prev_end, prev_owner = end, owner
        free = sorted(al.starts.items())
        if len(al.ends) != len(free) or any(al.ends.get(e) != st for st, e in free):
            errs.append(f"segment {s.name}: free start/end indexes disagree")
        keys = sorted(((e - st) << SHIFT) | st for st, e in free)
        if list(al.by_size) != keys:
            errs.append(f"segment {s.name}: free size index disagrees with free extents")
        total_free = 0
        for i, (st, e) in enumerate(free):
            total_free += e - st
            if e <= st or st % a or e > al.size:
                errs.append(f"segment {s.name}: bad free extent [{st},{e})")
            if i and free[i - 1][1] >= st:
                kind = "not coalesced" if free[i - 1][1] == st else "overlap"
                errs.append(f"segment {s.name}: free extents {free[i - 1]} and {(st, e)} {kind}")
        if total_free != al.free_bytes:
            errs.append(f"segment {s.name}: free_bytes {al.free_bytes}, extents sum {total_free}")
        # free vs allocated: merge-walk both sorted lists
        i = j = 0
        while i < len(free) and j < len(used):
            fs, fe = free[i]
            us, ue, owner = used[j]
            if fs < ue and us < fe:
                errs.append(
                    f"segment {s.name}: free [{fs},{fe}) overlaps live {owner!r} [{us},{ue})"
                )
                break
            if fe <= us:
                i += 1
            else:
                j += 1
        alloc_bytes = sum(e - st for st, e, _ in used)
        if alloc_bytes + total_free != al.size:
            errs.append(
                f"segment {s.name}: accounting: allocated {alloc_bytes} + free {total_free}"
                f" != size {al.size}"
            )
    return errs
