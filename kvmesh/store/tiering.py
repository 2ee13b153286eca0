"""The disk tier's decisions, written once and without I/O: the part of the leader
(:class:`~.leader.Leader`, which owns one as ``leader.tiers``) that chooses what moves
between memory and disk (docs/store.md, "Disk tier").

* **Demotion**: above ``demote_watermark`` the oldest memory-only objects get a disk copy
  (:meth:`Tiering.demote_next`, chained by :meth:`Tiering.demote_ended` so that a node
  writes one batch while the other's end is under way); demotions not ended within
  ``demote_timeout_s`` are revoked; a disk whose node reported failures backs off
  (:meth:`Tiering.demote_failed`, :meth:`Tiering.disk_recovered`).
* **Eviction with a disk**: above memory's watermark victims with a COMPLETE disk copy lose
  only their memory copy (``DropReplica``, once no lease holds it: :meth:`Tiering.drop_demoted`);
  the others are evicted only when the disk has no room or for the object cap
  (:meth:`Tiering.tiering`, the tick's eviction step when disk segments are mounted).
* **Promotion on hit**: reads of disk-only objects are counted (:meth:`Tiering.count_hits`);
  at ``promote_hits`` the object gets a memory copy again (:meth:`Tiering.promotion`).

Like the rest of the leader it is fed explicit time and results and returns commands to
propose; what it holds is soft state a new leader rebuilds (:meth:`Tiering.elected`). The
leases, access stamps and holds it reads are the leader's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from .errors import Code
from .master import commands as C
from .master.eviction import choose_victims
from .master.objects import TIER_DISK
from .master.policy import (
    PutAges,
)
from .master.segments import DISK, MOUNTED
from .types import ObjectReplica, PromoteTask, ReplicaDesc

if TYPE_CHECKING:
    from .master.leases import AccessStamps, LeaseTable
    from .master.policy import HoldTracker
    from .master.state import StoreStateMachine


class LeaderView(Protocol):
    """What the tier's decisions read of their leader (:class:`~.leader.Leader`): its
    current lease table, access stamps and holds (a new leadership replaces them), its
    eviction bookkeeping and the object cap's excess."""

    cfg: Any  # LeaderConfig
    sm: StoreStateMachine
    leases: LeaseTable
    stats: AccessStamps
    holds: HoldTracker

    def evicted(self, cmd: Any, result: Any) -> list[str]: ...

    def object_excess(self) -> int: ...


__all__ = ["DEMOTE_DEPTH", "NEVER", "Tiering"]

NEVER = float("inf")  # a timeout never reached (stale puts and demotions go by version)
_MAX_HITS = 1 << 16  # disk-only keys whose reads a leader counts (promotion on hit)
# DemoteStart batches one decision proposes at most (a tick, a DemoteEnd's chain, a node's
# ask): two, so that a node writes one while the other's end is under way
DEMOTE_DEPTH = 2


class Tiering:
    """The disk tier's soft state and decisions of one leadership (``leader.tiers``)."""

    def __init__(self, leader: LeaderView) -> None:
        self._ld = leader
        self.sm = leader.sm
        self.cfg = leader.cfg
        self.demote_ages = PutAges()  # demotions in flight, as puts (the disk tier)
        # DemoteStarts proposed and not yet applied: id -> (command, when, memory bytes).
        # They count against demote_inflight_bytes as the applied ones do, so that the
        # tick's and a DemoteEnd's chained batch never overlap or pass the cap together; one
        # whose result never came (a driver that lost it) is forgotten after the timeout.
        self._starts: dict[int, tuple[C.DemoteStart, float, int]] = {}
        self.demoted_total = 0  # objects whose memory copy this leader freed after demotion
        # promotion on hit: reads of disk-only objects counted (bounded), the keys due, and
        # the promotions in flight: reservation tag -> (when, [(key, version, sid, offset)])
        self._hits: dict[str, int] = {}
        self._promotions: dict[int, tuple[float, list[tuple[str, int, int, int]]]] = {}
        self.promoted_total = 0
        self._disk_full_until = float("-inf")
        # per-disk backoff after failed demotions its node reported (DemoteEndReq.failed):
        # disk segment id -> (no new demotion placed there until, failures in a row). Not
        # a full disk: eviction goes on treating the disk as having room (no object that
        # is in memory only is evicted for it), only demotion waits
        self._disk_backoff: dict[int, tuple[float, int]] = {}
        self.demote_failed_total = 0  # demotions their node reported failed (revoked)

    def elected(self) -> None:
        """A new leadership: every demotion in flight gets a full timeout from now; an
        earlier leader's promotions lapse with their reservations (Release)."""
        self.demote_ages = PutAges()
        self._starts.clear()
        self._disk_backoff.clear()
        self._hits.clear()
        self._promotions.clear()

    def count_hits(self, keys: list[str]) -> None:
        """Reads of ``keys``: count those of disk-only objects (promotion on hit)."""
        tier, hits = self.sm.tier_of, self._hits
        for k in keys:
            if tier(k) == TIER_DISK:
                hits[k] = hits.get(k, 0) + 1
        if len(hits) > _MAX_HITS:
            hits.clear()  # (an approximate count: a flood of one-off reads starts over)

    def disk_room(self, now: float) -> bool:
        """Whether demotion can give memory-only objects a disk copy now (no NoSpace answer
        within the last turns, free disk bytes, no object cap to meet)."""
        sm = self.sm
        return not self._ld.object_excess() and now >= self._disk_full_until and sm.disk_free() > 0

    def split(
        self, keys: list[str], versions: list[int]
    ) -> tuple[tuple[list[str], list[int]] | None, tuple[list[str], list[int]] | None]:
        """Victims with a COMPLETE disk copy, and the others (None: none)."""
        tier = self.sm.tier_of
        d = [(k, v) for k, v in zip(keys, versions) if tier(k) == TIER_DISK]
        r = [(k, v) for k, v in zip(keys, versions) if tier(k) != TIER_DISK]
        return (
            ([k for k, _ in d], [v for _, v in d]) if d else None,
            ([k for k, _ in r], [v for _, v in r]) if r else None,
        )

    def tiering(self, now: float, wall: float) -> Iterator[tuple[Any, Callable[[Any], Any] | None]]:
        """The tick's eviction step when disk segments are mounted (docs/store.md, "Disk
        tier"), as ``(command, done)`` pairs like :meth:`tick`: revoke demotions their node
        did not end within ``demote_timeout_s``; evict disk-only objects above the disk's
        watermark; above memory's, victims with a COMPLETE disk copy lose their memory copy
        (``DropReplica``), the others are evicted only when the disk has no room or for the
        object cap; from ``demote_watermark`` on, the oldest objects get a disk copy
        (``DemoteStart``) while the demotions in flight do not already bring memory below
        it."""
        sm, cfg = self.sm, self.cfg
        stale = self.demote_ages.stale(sm.demoting(), now, cfg.demote_timeout_s, cfg.max_batch_keys)
        if stale:
            yield C.DemoteRevoke([k for k, _ in stale], [v for _, v in stale]), None
        hw, ratio = cfg.high_watermark, cfg.evict_ratio
        dplan = choose_victims(sm, self._ld.leases, self._ld.stats, now, hw, ratio, medium="disk")
        if dplan.keys:
            self._ld.leases.block(dplan.keys)
            dev = C.Evict(dplan.keys, dplan.versions, now=wall, allow_soft=dplan.allow_soft)
            yield dev, lambda r: self._ld.evicted(dev, r)
        excess = self._ld.object_excess()
        plan = choose_victims(
            sm, self._ld.leases, self._ld.stats, now, hw, ratio, objects=excess, medium="memory"
        )
        gone: set[str] = set()
        if plan.keys:
            drop, rest = self.split(plan.keys, plan.versions)
            if drop:
                self._ld.leases.block(drop[0])
                dr = C.DropReplica(*drop)
                yield dr, lambda r: self._ld.evicted(dr, r)
            if rest is not None and (excess or now < self._disk_full_until or sm.disk_free() <= 0):
                self._ld.leases.block(rest[0])
                ev = C.Evict(rest[0], rest[1], now=wall, allow_soft=plan.allow_soft)
                gone.update(rest[0])
                yield ev, lambda r: self._ld.evicted(ev, r)
        pr = self.promotion(now)
        if pr is not None:
            yield pr, lambda r: self.promote_started(pr, r, now)
        if excess or now < self._disk_full_until or sm.disk_free() <= 0:
            return
        yield from self._demote_more(now, wall, gone)

    def _demote_more(
        self, now: float, wall: float, gone: Iterable[str] = ()
    ) -> list[tuple[C.DemoteStart, Callable[[Any], Any]]]:
        """Up to ``DEMOTE_DEPTH`` batches of :meth:`demote_next` at once, as ``(command,
        done)`` pairs: a node then knows its next batch while it ends one (it writes the
        next while the last one's fdatasync and DemoteEnd are under way, tiercopy.py
        ``TierCopier.demote``), instead of waiting a DemoteEnd round trip for it."""
        out: list[tuple[C.DemoteStart, Callable[[Any], Any]]] = []
        if not self.sm.has_disk():
            return out
        for _ in range(DEMOTE_DEPTH):
            ds = self.demote_next(now, wall, gone)
            if ds is None:
                break
            out.append((ds, lambda r, ds=ds: self.demote_started(ds, r, now)))
        return out

    def demote_next(
        self, now: float, wall: float, gone: Iterable[str] = ()
    ) -> C.DemoteStart | None:
        """The next demotion batch, if any (the tick's last tiering step, and
        :meth:`demote_ended`'s chained one): from the level eviction brings memory down to,
        the oldest objects get disk copies, so that when memory reaches its watermark their
        memory is freed at once. Demotions in flight -- applied, or proposed and not yet
        applied (``_starts``) -- count as done (a pipeline, not a pile-up), and stay
        under ``demote_inflight_bytes``. ``gone``: keys being evicted meanwhile. The caller
        reports the result to :meth:`demote_started`."""
        sm, cfg = self.sm, self.cfg
        if not self.disk_room(now):
            return None
        avoid = self._backing_off(now)
        if avoid is None:
            return None  # every disk backs off: the objects wait in memory
        dw = self._demote_level()
        u = sm.usage()
        objs = sm.objects
        starts = self._starts
        for i in [i for i, (_, t, _) in starts.items() if now - t > cfg.demote_timeout_s]:
            del starts[i]
        proposed = sum(b for _, _, b in starts.values())
        pending = proposed + sum(sm.medium_bytes(objs[k], "memory") for k, _ in sm.demoting())
        if not u.capacity or u.used - pending < dw * u.capacity:
            return None
        if u.used - pending - sm.reclaimable_bytes() <= 0:
            return None  # nothing in memory only (with write-through: the usual case)
        if pending >= cfg.demote_inflight_bytes:
            return None
        # the oldest objects already on disk count as freed (those in flight are no victims);
        # demote the next ones, a large batch (each costs round trips whatever its size)
        # (at most the room between the demotion and the eviction watermarks: with batches
        # chained, the writer refills memory while the next batch copies, where one batch of
        # all of memory would alternate the two; smaller batches cost more round trips than
        # they overlap, measured with bench/tier.py)
        room = max(cfg.high_watermark - dw, cfg.evict_ratio) * u.capacity
        batch = min(max(int(cfg.evict_ratio * u.capacity), cfg.demote_batch_bytes),
                    cfg.demote_inflight_bytes - pending, max(int(room), 1))  # fmt: skip
        # (the keys of proposed batches are still candidates to it: skipped below)
        need = batch + sm.reclaimable_bytes() + proposed
        # (leased objects too: copying them is harmless, only freeing waits for the lease)
        ahead = choose_victims(
            sm, self._ld.leases, self._ld.stats, now, dw, cfg.evict_ratio, need=need,
            medium="memory", copy=True,
        )  # fmt: skip
        _, rest = self.split(ahead.keys, ahead.versions)
        if rest is None:
            return None
        skip = set(gone)
        for c, _, _ in starts.values():
            skip.update(c.keys)
        keep = [(k, v) for k, v in zip(*rest) if k not in skip]
        if not keep:
            return None
        # bytes up to the batch (choose_victims counts the memory of objects already on disk
        # as freed; of those it picked, ours are the next ``batch`` bytes at most)
        ks, vs, got = [], [], 0
        for k, v in keep:
            if got >= batch:
                break
            ks.append(k)
            vs.append(v)
            got += sm.medium_bytes(objs[k], "memory")
        ds = C.DemoteStart(ks, vs, now=wall, allow_soft=ahead.allow_soft, avoid=avoid)
        starts[id(ds)] = (ds, now, got)
        return ds

    def _backing_off(self, now: float) -> list[int] | None:
        """The ids of mounted disk segments in their backoff (their next DemoteStart's
        ``avoid``); None when every one is."""
        back = self._disk_backoff
        if not back:
            return []
        disks = [s.id for s in self.sm.segs.values() if s.medium == DISK and s.state == MOUNTED]
        out = [sid for sid in disks if back.get(sid, (0.0, 0))[0] > now]
        return None if disks and len(out) == len(disks) else out

    def demote_failed(
        self, node_id: str, keys: list[str], versions: list[int], now: float
    ) -> C.DemoteRevoke | None:
        """Node ``node_id`` could not write the disk copies of ``keys`` (ENOSPC, EIO: its
        ``DemoteEndReq.failed``): the DemoteRevoke of those whose PROCESSING disk copy at
        that version is on its disk -- any other name is not its to give up -- so that
        their memory copies stay the only ones and a later batch tries again; and that disk
        backs off: no DemoteStart places on it for ``4 x ticker_s`` doubling per failure
        in a row, at most ``demote_timeout_s`` (what a silent failure waited before)."""
        sm, cfg = self.sm, self.cfg
        ks, vs, disks = [], [], set()
        for k, v in zip(keys, versions):
            sids = sm.demoting_disk(k, v, node_id)
            if sids is None or k in ks:
                continue
            ks.append(k)
            vs.append(v)
            disks.update(sids)
        if not ks:
            return None
        self.demote_failed_total += len(ks)
        back = self._disk_backoff
        for sid in disks:
            n = back.get(sid, (0.0, 0))[1] + 1
            delay = min(4 * cfg.ticker_s * 2 ** min(n - 1, 30), cfg.demote_timeout_s)
            back[sid] = (now + delay, n)
        return C.DemoteRevoke(ks, vs)

    def disk_recovered(self, node_id: str) -> None:
        """A DemoteEnd of ``node_id`` made disk copies COMPLETE: its disks back off no more."""
        back = self._disk_backoff
        if back:
            for s in self.sm.segs.values():
                if s.node_id == node_id:
                    back.pop(s.id, None)

    def _demote_level(self) -> float:
        """The memory level demotion starts at: 0 with write-through (every object), else
        ``demote_watermark`` (0: ``high_watermark - evict_ratio``)."""
        cfg = self.cfg
        if cfg.write_through:
            return 0.0
        return cfg.demote_watermark or max(0.0, cfg.high_watermark - cfg.evict_ratio)

    def demote_ended(
        self, cmd: C.DemoteEnd, result: Any, now: float, wall: float
    ) -> list[tuple[Any, Callable[[Any], Any]]]:
        """A node's DemoteEnd applied (``result``; None: failed or unknown): what to propose
        now rather than at the next tick, as ``(command, done)`` pairs proposed together --
        the DropReplica of the memory of the keys now on disk while memory is over its
        watermark (:meth:`drop_demoted`), and the next batch (:meth:`demote_next`) now that
        this one no longer counts against ``demote_inflight_bytes``: the node's reply
        carries it (docs/store.md, "Disk tier"), so a node that keeps up never waits for a
        tick or a poll between batches."""
        if result is None:
            return []
        out: list[tuple[Any, Callable[[Any], Any]]] = []
        ok = [k for k, c in zip(cmd.keys, result.codes) if c == 0]
        drop = self.drop_demoted(ok, now)
        if drop is not None:
            out.append((drop, lambda r: self._ld.evicted(drop, r)))
        gone = drop.keys if drop is not None else ()
        out.extend(self._demote_more(now, wall, gone))
        return out

    def promotion(self, now: float) -> C.PromoteStart | None:
        """Promotion on hit (``promote_hits``): the disk-only objects read that many times
        get a memory copy back (``PromoteStart``), while memory has room below the level
        demotion starts at -- a promoted object is on both media, its memory the first
        freed when memory is needed again. Not while its promotion is in flight."""
        n = self.cfg.promote_hits
        if not n or not self._hits:
            return None
        sm, cfg = self.sm, self.cfg
        due = [k for k, h in self._hits.items() if h >= n]
        if not due:
            return None
        busy = {k for _, ks in self._promotions.values() for k, _, _, _ in ks}
        u = sm.usage()
        dw = cfg.demote_watermark or max(0.0, cfg.high_watermark - cfg.evict_ratio)
        # (the memory of objects on both media counts as free: it is dropped when needed)
        room = dw * u.capacity - u.used + sm.reclaimable_bytes()
        a = sm.config.align
        ks, vs = [], []
        for k in due:
            if k in busy:
                continue
            v = sm.promotable(k)
            if not v:
                self._hits.pop(k, None)  # gone, or back in memory
                continue
            need = (sm.objects[k].size + a - 1) & -a
            if need > room or len(ks) >= cfg.max_batch_keys:
                break
            room -= need
            ks.append(k)
            vs.append(v)
        return C.PromoteStart(ks, vs) if ks else None

    def promote_started(self, cmd: C.PromoteStart, result: Any, now: float) -> None:
        """A PromoteStart applied (``result``) or failed (None): its promotions are in
        flight until ended, or until its reservation is released after ``demote_timeout_s``
        (the node never ended them: the object stays on disk)."""
        if result is None:
            return
        for k, c in zip(cmd.keys, result.codes):
            if c != int(Code.NO_AVAILABLE_HANDLE):
                self._hits.pop(k, None)  # started, or not promotable: counted afresh
        if not result.tag:
            return
        got = [
            (k, v, sid, off)
            for k, v, c, sid, off in zip(
                cmd.keys, cmd.versions, result.codes, result.sids, result.offsets
            )  # fmt: skip
            if c == 0
        ]
        self._promotions[result.tag] = (now, got)
        self._ld.holds.note(result.tag, now + self.cfg.demote_timeout_s)

    def promote_tasks(self, node_id: str, limit: int) -> list[Any]:
        """The promotions in flight whose disk copy is on ``node_id`` (at most ``limit``):
        what a heartbeat asking for work is also answered with."""
        sm = self.sm
        out: list[Any] = []
        for tag in [t for t in self._promotions if t not in sm.reserved]:
            del self._promotions[tag]  # released (timed out) or all ended
        segs = sm.segs
        for tag, (_, ks) in self._promotions.items():
            for k, v, sid, off in ks:
                if len(out) >= limit:
                    return out
                s = segs.get(sid)
                if s is None or s.node_id != node_id or sm.promotable(k) != v:
                    continue
                o = sm.objects[k]
                dst = ReplicaDesc(s.name, s.node_id, s.endpoint, off, o.size)
                ((dname, doff),) = sm.disk_copy(k)
                d = segs[sm.by_name[dname]]
                src = ReplicaDesc(d.name, d.node_id, d.endpoint, doff, o.size)
                rep = ObjectReplica
                out.append(PromoteTask(tag, k, v, o.size, o.crc, rep([src]), rep([dst])))
        return out

    def plan_promote_end(self, cmd: C.PromoteEnd) -> C.PromoteEnd:
        """The part of a node's PromoteEnd that names promotions this leader started, as
        it started them (tag, key, version, its node's segment, offset): an end naming any
        other reservation -- a writer's, or an earlier leader's promotion -- is refused
        before the log, as a PutCommit into another session's reservation is."""
        got = self._promotions.get(cmd.tag)
        segs, by_name = self.sm.segs, self.sm.by_name
        mine = set() if got is None else {(k, v, sid, off) for k, v, sid, off in got[1]}
        keep = [
            i
            for i, (k, v, name, off) in enumerate(
                zip(cmd.keys, cmd.versions, cmd.segments, cmd.offsets)
            )
            if (k, v, by_name.get(name), off) in mine and segs[by_name[name]].node_id == cmd.node_id
        ]
        return C.PromoteEnd(
            cmd.node_id, cmd.tag, [cmd.keys[i] for i in keep], [cmd.versions[i] for i in keep],
            [cmd.segments[i] for i in keep], [cmd.offsets[i] for i in keep],
        )  # fmt: skip

    def promote_ended(self, cmd: C.PromoteEnd, result: Any) -> None:
        """A node's PromoteEnd applied (``result``) or failed (None)."""
        if result is None:
            return
        ok = {k for k, c in zip(cmd.keys, result.codes) if c == 0}
        self.promoted_total += len(ok)
        got = self._promotions.get(cmd.tag)
        if got is not None:
            rest = [x for x in got[1] if x[0] not in ok]
            if rest:
                self._promotions[cmd.tag] = (got[0], rest)
            else:
                del self._promotions[cmd.tag]

    def demote_asked(self, now: float, wall: float) -> list[tuple[Any, Callable[[Any], Any]]]:
        """A node with a disk asked for demotions and has none in flight: the next batch
        if one is due (:meth:`demote_next`), now rather than at the next tick -- a writer
        that refilled memory since the last end is met at the node's next poll."""
        return list(self._demote_more(now, wall))

    def demote_started(self, cmd: C.DemoteStart, result: Any, now: float) -> None:
        """A DemoteStart of :meth:`demote_next` applied (``result``) or failed (None)."""
        got = self._starts.get(id(cmd))
        if got is not None and got[0] is cmd:
            del self._starts[id(cmd)]
        self.demote_ages.stale(self.sm.demoting(), now, NEVER)  # their timeout runs from now
        if result is not None and int(Code.NO_AVAILABLE_HANDLE) in result.codes and not cmd.avoid:
            # the disk is full (or too fragmented) for some: evict until a turn later (not
            # when disks backing off were avoided: their room is not gone, and objects in
            # memory only must not be evicted for a backoff)
            self._disk_full_until = now + 2 * self.cfg.ticker_s

    def drop_demoted(self, keys: list[str], now: float) -> C.DropReplica | None:
        """Right after a DemoteEnd applied (its handler asks, a tick earlier than the
        ticker would): while memory is over its watermark, the DropReplica of the memory
        copies of those keys whose disk copy is COMPLETE now and that no reader leases,
        blocked from new leases until :meth:`evicted`."""
        sm = self.sm
        u = sm.usage()
        if not u.capacity or u.used < self.cfg.high_watermark * u.capacity:
            return None
        leases = self._ld.leases
        ks, vs = [], []
        for k in keys:
            info = sm.evict_info(k, "memory")
            if (
                info is None
                or sm.tier_of(k) != TIER_DISK
                or leases.leased(k, now)
                or leases.blocked(k)
                or info[2] == 2  # hard pin
            ):
                continue
            ks.append(k)
            vs.append(info[0])
        if not ks:
            return None
        leases.block(ks)
        return C.DropReplica(ks, vs)

    def plan_drop_corrupt(self, keys: list[str], crcs: list[int]) -> C.DropReplica:
        """The DropReplica of the disk copies a reader found corrupt: those that still
        record the crc it checked against (a copy written since is not blamed). No lease
        rule: a reader of those bytes fails its own check the same way."""
        sm = self.sm
        objs = sm.objects
        ks, vs = [], []
        for k, c in zip(keys, crcs):
            r = objs.index.get(k)
            if r is not None and objs.tier.item(r) == TIER_DISK and objs.crc.item(r) == c:
                ks.append(k)
                vs.append(objs.version.item(r))
        return C.DropReplica(ks, vs, medium="disk")

    def demote_tasks(self, node_id: str, limit: int) -> list[Any]:
        """The demotions a heartbeat of ``node_id`` asking for work is answered with."""
        return self.sm.demote_tasks(node_id, limit)
