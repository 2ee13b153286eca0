"""The leader's soft state and decisions, written once and without I/O: run by the asyncio
service (``service.py``) and by the simulator (``master/sim/``), as
:mod:`kvmesh.replog.readypath` is by the log's driver and its simulator.

A :class:`Leader` is fed explicit time (the leader's monotonic ``now`` for leases, put ages
and liveness; its wall clock ``wall`` only where a command carries one) and events
(elected, an entry about to apply, a heartbeat, a read, a command's result) and returns the
commands to propose. It never proposes, sleeps or reads a clock: the driver does, then
reports the result back (``None``: the outcome is unknown, the proposal failed or timed
out). What it holds is not replicated: a new leader builds it from scratch
(:meth:`Leader.elected`), pessimistic where an earlier leader's state is unknown.

* **Leases and the new leader's grace** (:class:`~.master.leases.LeaseTable`,
  :class:`~.master.leases.TermStart`): until one lease period after it starts leading,
  every object an earlier leader may have leased counts as leased; those created or
  completed in this term do not (docs/store-master.md, "The new leader's grace period").
* **Access order** (:class:`~.master.leases.AccessStamps`: the table's stamp column) for
  eviction.
* **Node liveness** (:class:`~.master.liveness.LivenessJudge`), judged over time this leader
  could hear: :meth:`Leader.heartbeat`, :meth:`Leader.observe`, :meth:`Leader.expiry`.
* **What each tick proposes** (:meth:`Leader.tick`), in order: :meth:`Leader.expiry` (ExpireNodes),
  :meth:`Leader.reclaim` (PutRevoke of stale puts judged on the monotonic clock, Reclaim to
  finish drains), :meth:`Leader.release` (Release of held bytes whose leases are over),
  :meth:`Leader.eviction` (Evict above the watermark or the object cap; with disk segments
  the disk tier's step, :meth:`~.tiering.Tiering.tiering`: demotion to disk first), then
  :meth:`Leader.purge`.
* **The disk tier's decisions** (demotion, memory copies dropped once on disk, promotion on
  hit) are :class:`~.tiering.Tiering`'s, one per leader (``leader.tiers``).
* **Request planning** under the lease rules (:mod:`~.master.policy`): removes, removes by
  prefix, remove-all, upserts; the writer of each put this leader answered.

Around a proposal that may free or rewrite a key's bytes the caller blocks new leases on
the keys (:meth:`Leader.block`) until it applied (:meth:`Leader.unblock`); :meth:`eviction`
and :meth:`evicted` do it themselves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from .master import commands as C
from .master.eviction import EVICT_RATIO, HIGH_WATERMARK, choose_victims
from .master.leases import DEFAULT_LEASE_TTL, DEFAULT_NODE_TTL, AccessStamps, LeaseTable, TermStart
from .master.liveness import LivenessJudge, Verdict, default_max_gap, node_capacity
from .master.policy import (
    HoldTracker,
    PutAges,
    RemovePlan,
    UpsertPlan,
    plan_remove,
    plan_remove_prefix,
    plan_upsert,
)
from .tiering import NEVER, Tiering
from .types import MAX_BATCH_KEYS

if TYPE_CHECKING:
    from .master.state import StoreStateMachine

__all__ = ["Leader", "LeaderConfig"]

_MAX_WRITERS = 1 << 20  # put -> writer session bindings kept by a leader


class LeaderConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The leader's policy (the service's :class:`~.config.ServiceConfig` takes its
    defaults from here)."""

    lease_ttl_s: float = DEFAULT_LEASE_TTL
    put_timeout_s: float = 60.0  # PROCESSING objects older than this are reclaimed
    node_ttl_s: float = DEFAULT_NODE_TTL  # storage nodes silent for this long are unmounted
    # a node silent for node_ttl_s is suspect, and expired after node_suspect_s more (0:
    # half the TTL); a gap over liveness_max_gap_s between two of the leader's own
    # observations is a stall (0: min(TTL/4, max(1 s, 4 ticker turns))); one expiry round
    # drops at most expire_max_fraction of the nodes and of their bytes
    node_suspect_s: float = 0.0
    liveness_max_gap_s: float = 0.0
    expire_max_fraction: float = 0.5
    ticker_s: float = 0.25
    high_watermark: float = HIGH_WATERMARK
    evict_ratio: float = EVICT_RATIO
    # objects in the master at most (PROCESSING included; 0: no cap): eviction starts at
    # high_watermark of it as for bytes
    max_objects: int = 0
    max_batch_keys: int = 8192  # puts one PutRevoke names at most
    # the disk tier: a demotion its node has not ended within this is revoked; demotion
    # starts at demote_watermark of memory (0: high_watermark - evict_ratio, where eviction
    # stops), ahead of the watermark at which demoted objects lose their memory copy
    demote_timeout_s: float = 30.0
    demote_watermark: float = 0.0
    # bytes one tick's DemoteStart names at least (evict_ratio of memory when larger), and
    # the bytes of demotions in flight at most: a demotion costs a tick, a node's poll and
    # two log entries whatever its size, so batches are large and several are in flight
    demote_batch_bytes: int = 64 << 20
    demote_inflight_bytes: int = 256 << 20
    # an expired node's disk segment (with a disk id) stays offline this long, its COMPLETE
    # copies listed for a restart to re-adopt (docs/store.md, "Restart re-adoption")
    disk_offline_ttl_s: float = 600.0
    # promotion on hit: a disk-only object read this many times (0: never) gets a memory
    # copy again, filled by its disk's node (PromoteStart/PromoteEnd, docs/store.md)
    promote_hits: int = 0
    # write-through: every object gets a disk copy as soon as it is in memory (demotion
    # from an empty memory on), its memory kept until memory is needed
    write_through: bool = False

    def __post_init__(self) -> None:
        if self.lease_ttl_s <= 0 or self.put_timeout_s <= 0 or self.node_ttl_s <= 0:
            raise ValueError("lease_ttl_s, put_timeout_s and node_ttl_s must be positive")
        if self.demote_timeout_s <= 0 or self.disk_offline_ttl_s <= 0:
            raise ValueError("demote_timeout_s and disk_offline_ttl_s must be positive")
        if not 0.0 <= self.demote_watermark <= 1.0:
            raise ValueError("demote_watermark must be in [0, 1] (0: the default)")
        if self.demote_batch_bytes <= 0 or self.demote_inflight_bytes < self.demote_batch_bytes:
            raise ValueError("demote_batch_bytes must be positive, demote_inflight_bytes >= it")
        if self.max_objects < 0:
            raise ValueError("max_objects must not be negative (0: no cap)")
        if self.promote_hits < 0:
            raise ValueError("promote_hits must not be negative (0: off)")
        if self.node_suspect_s < 0 or self.liveness_max_gap_s < 0:
            raise ValueError("node_suspect_s and liveness_max_gap_s must not be negative")
        if not 0.0 < self.expire_max_fraction <= 1.0:
            raise ValueError("expire_max_fraction must be in (0, 1]")
        if not 0.0 < self.high_watermark <= 1.0 or not 0.0 < self.evict_ratio <= 1.0:
            raise ValueError("high_watermark and evict_ratio must be in (0, 1]")
        if not 0 < self.max_batch_keys <= MAX_BATCH_KEYS:
            raise ValueError(f"max_batch_keys must be in 1..{MAX_BATCH_KEYS}")

    @property
    def reclaim_every_s(self) -> float:
        """How often the tick looks for stale puts (a quarter of their timeout, at most 2 s)."""
        return min(self.put_timeout_s / 4, 2.0)


class Leader:
    """One replica's leadership state over its state machine ``sm`` (read, never written:
    every change goes through a command the caller proposes)."""

    def __init__(self, cfg: LeaderConfig, sm: StoreStateMachine, now: float) -> None:
        self.cfg = cfg
        self.sm = sm
        # Before this replica leads: everything counts as leased, nothing as fresh.
        self.leases = LeaseTable(start=now, grace=cfg.lease_ttl_s)
        self.term_start = TermStart(1 << 62)
        self.liveness = self._judge(now)
        self.stats = AccessStamps(sm)
        self.holds = HoldTracker(cfg.lease_ttl_s)
        self.put_ages = PutAges()
        self.removing_all = 0  # RemoveAll proposals in flight: no new leases at all
        self.suspects: list[str] = []
        self.verdict = Verdict()
        self.expired_total = 0  # nodes expired by this replica's leaderships
        self.last_expiry = 0.0  # heard time of the last expiry round
        self.evicted_total = 0
        self._last_reclaim = float("-inf")
        self._applied: Callable[[], int] = lambda: 0
        # version (log index) of a put this leader answered -> the session that started it.
        # One entry per PutStart entry, not per key: every key an entry places has its
        # index as version, so the version names the writer. Kept for two put timeouts
        # (oldest first; the put is reclaimed by then), at most _MAX_WRITERS.
        self._writers: dict[int, int] = {}
        self._writer_times: deque[tuple[float, int]] = deque()
        self.tiers = Tiering(self)  # the disk tier's decisions (demotion, promotion)
        # reservation (its tag) this leader granted -> the session it belongs to: a
        # PutCommit naming any other tag (another session's, one granted by an earlier
        # leader) is refused before the log
        self._reservations: dict[int, int] = {}

    def _judge(self, now: float) -> LivenessJudge:
        cfg = self.cfg
        ttl = cfg.node_ttl_s
        return LivenessJudge(
            ttl,
            cfg.node_suspect_s or ttl / 2,
            cfg.liveness_max_gap_s or default_max_gap(ttl, cfg.ticker_s),
            cfg.expire_max_fraction,
            now,
        )

    # ------------------------------------------------------------------ leadership

    def elected(
        self, now: float, first_index: int, applied_index: Callable[[], int], alone: bool = False
    ) -> None:
        """This replica leads from ``now``. ``first_index``: its last log index when it
        learned it leads, plus one (every later entry is this term's); ``applied_index()``:
        the index applied so far. The previous leaders' leases are unknown here: every object
        one of them may have leased counts as leased for one lease period (:class:`TermStart`
        says which: not those created or completed in this term); nodes get a full heartbeat
        TTL from now. ``alone``: a lone replica holding no object can have no earlier leases
        and skips the period."""
        sm = self.sm
        self.term_start = TermStart(first_index)
        self._applied = applied_index
        self.leases = LeaseTable(
            start=now, grace=0.0 if alone else self.cfg.lease_ttl_s, fresh=self.fresh
        )
        self.liveness = self._judge(now)
        self.liveness.reset(sm.nodes(), now)
        self.stats = AccessStamps(sm)
        self.stats.reset()
        # Holds noted by an earlier leadership are judged by the blanket period instead.
        self.holds = HoldTracker(self.cfg.lease_ttl_s)
        self.put_ages = PutAges()  # every put in flight gets a full timeout from now
        self.tiers.elected()
        self.removing_all = 0
        self._last_reclaim = float("-inf")
        self._writers.clear()
        self._writer_times.clear()
        self._reservations.clear()

    def fresh(self, key: str) -> bool:
        """Whether no earlier leader can have leased ``key``'s object: the exceptions to
        the grace period (:class:`TermStart`)."""
        ts, sm = self.term_start, self.sm
        ts.observe(self._applied() + 1, sm.processing)  # every earlier entry applied?
        return ts.fresh(key, sm.version_of(key))

    def before_apply(self, index: int) -> None:
        """Entry ``index`` is about to apply on this replica (the grace's exceptions are
        judged on what was PROCESSING once every earlier term's entry applied)."""
        self.term_start.observe(index, self.sm.processing)

    # ------------------------------------------------------------------ reads, writes

    def lease(self, keys: list[str], now: float) -> list[float]:
        """Lease ``keys`` (found by a read) until ``now + ttl``: per key the expiry, or 0.0
        where a removal is in flight (no lease on memory about to be freed)."""
        if self.removing_all:
            return [0.0] * len(keys)
        return self.leases.grant(keys, now, self.cfg.lease_ttl_s)

    def touch(self, keys: list[str]) -> None:
        """Keys read or written (access order for eviction; with ``promote_hits``, the hits
        of disk-only objects)."""
        self.stats.touch(keys)
        if self.cfg.promote_hits and self.sm.has_disk():
            self.tiers.count_hits(keys)

    def forget(self, keys: Iterable[str]) -> None:
        """Keys gone (removed, evicted)."""
        self.stats.forget(keys)

    def block(self, keys: Iterable[str]) -> None:
        self.leases.block(keys)

    def unblock(self, keys: Iterable[str]) -> None:
        self.leases.unblock(keys)

    def blocked(self, key: str) -> bool:
        return self.leases.blocked(key)

    def bind_writer(self, version: int, client_id: int, now: float) -> None:
        """``client_id`` started the put of entry ``version`` (bindings older than two put
        timeouts are forgotten: those puts are reclaimed by now)."""
        w, times = self._writers, self._writer_times
        w[version] = client_id
        times.append((now, version))
        old = now - 2 * self.cfg.put_timeout_s - self.cfg.ticker_s
        while times and (times[0][0] < old or len(times) > _MAX_WRITERS):
            w.pop(times.popleft()[1], None)

    def foreign_versions(self, versions: Iterable[int], client_id: int) -> set[int]:
        """The versions among ``versions`` whose put another session started (on this
        leader; puts of an earlier leader are judged by version only)."""
        w = self._writers
        return {v for v in set(versions) if w.get(v, client_id) != client_id}

    def bind_reservation(self, tag: int, client_id: int, now: float) -> float:
        """Session ``client_id`` holds reservation ``tag`` (granted or used by a commit at
        ``now``): kept the lease TTL (at most the put timeout, the bound of a stalled
        writer's bytes) from now, then released unless used again. Returns that hold in
        seconds (an unknown tag gets at least as much on a new leader: HoldTracker)."""
        self._reservations[tag] = client_id
        hold = min(self.cfg.lease_ttl_s, self.cfg.put_timeout_s)
        self.holds.note(tag, now + hold)
        return hold

    def owns_reservation(self, tag: int, client_id: int) -> bool:
        """Whether ``tag`` is a live reservation this leader granted to ``client_id``."""
        return self._reservations.get(tag) == client_id and tag in self.sm.reserved

    def drop_reservation(self, tag: int) -> None:
        self._reservations.pop(tag, None)

    # ------------------------------------------------------------------ request plans

    def plan_remove(self, keys: list[str], now: float, force: bool = False) -> RemovePlan:
        """Leased keys answer ObjectHasLease, or with ``force`` are removed with their bytes
        held until the leases are over."""
        return plan_remove(self.leases, keys, now, force)

    def plan_upsert(self, exists: list[bool], cmd: C.Upsert, now: float) -> UpsertPlan:
        """An existing, leased key answers ObjectHasLease (an upsert would rewrite or free
        memory a reader is copying)."""
        return plan_upsert(self.leases, exists, cmd, now)

    def prefix_leased(self, now: float, force: bool) -> Callable[[str], bool] | None:
        """The predicate a remove-by-prefix scan skips keys by (None with ``force``)."""
        if force:
            return None
        leases = self.leases
        return lambda k: leases.leased(k, now)

    def plan_remove_prefix(
        self, prefix: str, found: list[str], skipped: int, more: bool, now: float, force: bool
    ) -> tuple[C.RemovePrefix, float]:
        """One round's entry and its hold's release time (the scan's keys checked again,
        synchronously with the caller's :meth:`block`)."""
        return plan_remove_prefix(prefix, found, skipped, more, self.leases, now, force)

    def plan_remove_all(self, now: float, force: bool) -> tuple[C.RemoveAll, float] | None:
        """The RemoveAll entry and its hold's release time; None while a new leader still
        applies the earlier terms' entries inside its grace (one of them may create a key
        the list of leased keys would miss, and RemoveAll then remove it under an old
        lease): the caller answers busy."""
        leases = self.leases
        if now < leases.blanket_until:
            if not self.term_start.settled:
                return None
            leased = leases.leased_keys(self.sm.keys(), now)
        else:
            leased = leases.all_leased(now)
        if force:
            release_at = max((leases.expiry(k) for k in leased), default=0.0)
            return C.RemoveAll(force=True, hold=release_at > 0.0), release_at
        return C.RemoveAll(skip=leased), 0.0

    def note_hold(self, tag: int, release_at: float) -> None:
        """An entry of this leader's (log index ``tag``) held bytes until ``release_at``."""
        self.holds.note(tag, release_at)

    # ------------------------------------------------------------------ liveness

    def heartbeat(self, node_id: str, now: float) -> bool:
        """A heartbeat of ``node_id`` at ``now``; False if the node has no segment here."""
        if node_id not in self.sm.nodes():
            return False
        self.liveness.beat(node_id, now)
        return True

    def mounted(self, node_id: str, now: float) -> None:
        """A Mount of ``node_id`` applied: it counts as heard from."""
        self.liveness.beat(node_id, now)

    def observe(self, now: float) -> bool:
        """The leader ran at ``now`` (its own periodic check, apart from the ticker); True if
        a stall just ended."""
        return self.liveness.observe(now)

    def expiry(self, now: float, wall: float) -> C.ExpireNodes | None:
        """The tick's first step: one liveness judgement (:attr:`verdict` keeps it) and the
        expiry it decides."""
        # (an offline disk segment has no node to hear from: it waits for re-adoption)
        live = [s for s in self.sm.segments() if s.state != "offline"]
        v = self.liveness.tick(now, node_capacity(live))
        self.verdict = v
        self.suspects = v.suspect
        nodes = {s.node_id for s in live}
        expire = [n for n in v.expire if n in nodes]
        if not expire:
            return None
        return C.ExpireNodes(
            node_ids=expire, now=wall, disk_offline_ttl=self.cfg.disk_offline_ttl_s
        )

    def expired(self, cmd: C.ExpireNodes, result: Any) -> None:
        """The ExpireNodes entry applied (``result``) or failed (None)."""
        if result is None:
            return
        codes = getattr(result, "codes", None)
        gone = cmd.node_ids if codes is None else [n for n, c in zip(cmd.node_ids, codes) if not c]
        self.liveness.expired(gone)
        self.last_expiry = self.liveness.heard
        self.expired_total += len(gone)

    # ------------------------------------------------------------------ the tick

    def tick(
        self, now: float, wall: float, evict: bool = True
    ) -> Iterator[tuple[Any, Callable[[Any], Any] | None]]:
        """What one ticker turn proposes, in order: ``(command, done)`` pairs, each
        decided once the one before was handled (a generator: the driver proposes a
        command, then calls ``done(result)`` -- ``None``: failed or unknown -- before asking
        for the next; one that proposes without waiting calls ``done`` when the result
        comes). ``evict``: False while the driver has an eviction in flight of its own."""
        exp = self.expiry(now, wall)
        if exp is not None:
            yield exp, lambda r: self.expired(exp, r)
        for cmd in self.reclaim(now, wall):
            yield cmd, None
        rel = self.release(now)
        if rel is not None:
            yield rel, lambda r: self.released(rel, r)
        if evict and self.sm.has_disk():
            yield from self.tiers.tiering(now, wall)
        else:
            ev = self.eviction(now, wall) if evict else None
            if ev is not None:
                yield ev, lambda r: self.evicted(ev, r)
        self.purge(now)

    def reclaim(self, now: float, wall: float) -> list[Any]:
        """Every :attr:`LeaderConfig.reclaim_every_s`: a PutRevoke of the puts stale on this
        leader's monotonic clock (:class:`PutAges`), freed by version, and a Reclaim that
        only finishes drains (its put cutoff is never reached) while a segment is not
        mounted: a wall clock that jumps or runs ahead on a new leader must not free memory
        a live writer is still writing."""
        cfg = self.cfg
        if now - self._last_reclaim < cfg.reclaim_every_s:
            return []
        self._last_reclaim = now
        out: list[Any] = []
        sm = self.sm
        stale = self.put_ages.stale(
            sm.processing_puts(), now, cfg.put_timeout_s, cfg.max_batch_keys
        )
        if stale:
            out.append(C.PutRevoke([k for k, _ in stale], [v for _, v in stale]))
        if any(s.state != "mounted" for s in sm.segments()):
            out.append(C.Reclaim(now=wall, put_timeout=NEVER))
        return out

    def release(self, now: float) -> C.Release | None:
        """A Release of the bytes of forced removes once every lease on them is over."""
        tags = self.sm.held_tags()
        if not tags:
            return None
        return self.holds.due(tags, self.leases, now)

    def released(self, cmd: C.Release, result: Any) -> None:
        if result is not None:
            self.holds.forget(cmd.tags)
            for t in cmd.tags:
                self._reservations.pop(t, None)

    def object_excess(self) -> int:
        """Objects to evict for the object cap: none below its high watermark, else down
        to ``high_watermark - evict_ratio`` of it (as for bytes)."""
        cfg = self.cfg
        cap = cfg.max_objects
        n = self.sm.object_count()
        if not cap or n < cfg.high_watermark * cap:
            return 0
        return max(1, n - int((cfg.high_watermark - cfg.evict_ratio) * cap))

    def eviction(self, now: float, wall: float, need: int = 0, objects: int = 0) -> C.Evict | None:
        """An Evict if usage is above the watermark (or ``need`` bytes, ``objects`` objects
        are wanted), its victims blocked from new leases until :meth:`evicted`. Leases are
        judged on the monotonic clock; soft pins then look live (their expiry is wall time),
        which only makes the choice more conservative -- ``apply`` re-checks pins against the
        command's wall-clock ``now``."""
        cfg = self.cfg
        plan = choose_victims(
            self.sm,
            self.leases,
            self.stats,
            now,
            cfg.high_watermark,
            cfg.evict_ratio,
            need=need,
            objects=max(objects, self.object_excess()),
        )
        if not plan.keys:
            return None
        self.leases.block(plan.keys)
        return C.Evict(keys=plan.keys, versions=plan.versions, now=wall, allow_soft=plan.allow_soft)

    def evictions(
        self, now: float, wall: float, need: int = 0, objects: int = 0, reserve: bool = False
    ) -> list[C.Evict | C.DropReplica]:
        """:meth:`eviction` for a put that found no room, with the disk tier: the victims
        whose disk copy is COMPLETE lose only their memory copy (``DropReplica``), the rest
        are evicted; each command's victims blocked until :meth:`evicted`. ``reserve``: the
        room is for a writer's reservation (bytes of puts not yet made): while the disk has
        room, only memory copies with a disk copy go -- an object in memory only gets its
        disk copy from demotion shortly, and no guess at a next put is worth losing it."""
        sm = self.sm
        if not sm.has_disk():
            ev = self.eviction(now, wall, need, objects)
            return [] if ev is None else [ev]
        if reserve and not self.tiers.disk_room(now):
            reserve = False  # the disk cannot take them: evicted as without the tier
        cfg = self.cfg
        plan = choose_victims(
            sm, self.leases, self.stats, now, cfg.high_watermark, cfg.evict_ratio,
            need=need, objects=max(objects, self.object_excess()), medium="memory",
        )  # fmt: skip
        drop, rest = self.tiers.split(plan.keys, plan.versions)
        out: list[C.Evict | C.DropReplica] = []
        if drop:
            self.leases.block(drop[0])
            out.append(C.DropReplica(*drop))
        if rest and not reserve:
            self.leases.block(rest[0])
            out.append(C.Evict(rest[0], rest[1], now=wall, allow_soft=plan.allow_soft))
        return out

    def evicted(self, cmd: C.Evict | C.DropReplica, result: Any) -> list[str]:
        """The Evict (or DropReplica) entry applied (``result``) or failed (None): the keys
        it freed (a DropReplica's keys stay, on their other medium)."""
        self.leases.unblock(cmd.keys)
        if result is None:
            return []
        gone = [k for k, c in zip(cmd.keys, result.codes) if c == 0]
        if type(cmd) is C.DropReplica and cmd.medium == "memory":
            self.tiers.demoted_total += len(gone)
            return gone
        if type(cmd) is C.DropReplica:
            gone = [k for k in gone if k not in self.sm.objects]
        self.stats.forget(gone)
        self.evicted_total += len(gone)
        return gone

    def purge(self, now: float) -> None:
        """The tick's last step: forget expired leases and reservations no longer held
        (memory only)."""
        self.leases.purge(now)
        held = self.sm.reserved
        for t in [t for t in self._reservations if t not in held]:
            del self._reservations[t]
