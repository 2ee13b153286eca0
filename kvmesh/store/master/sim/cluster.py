"""The store simulator's world: three replicas on the hand-driven Raft network, the
production leader driven as the service drives it, storage nodes, faults and the main loop."""

from __future__ import annotations

import heapq
import random
import zlib
from collections.abc import Callable
from typing import Any

from ....replog import (
    EntryKind,
    History,
    NotLeader,
    ProposalDropped,
    RaftConfig,
    ReplogError,
    Role,
    check,
)
from ....replog.sim.harness import Network
from ...leader import Leader, LeaderConfig
from ..commands import (
    DemoteEnd,
    Evict,
    ExpireNodes,
    Mount,
    PromoteEnd,
    Reclaim,
    Release,
    Unmount,
    encode_command,
)
from ..state import MasterConfig, StoreStateMachine
from .checks import Checks
from .clients import Clients, Read
from .config import SimConfig, SimResult, SimViolation
from .model import StoreModel, StoreOp
from .plants import planted

__all__ = ["StoreSim"]

_NORMAL = int(EntryKind.NORMAL)


class _Proposal:
    __slots__ = ("term", "cb", "deadline", "done")

    def __init__(self, term: int, cb: Callable[[Any], None], deadline: float) -> None:
        self.term = term
        self.cb = cb
        self.deadline = deadline
        self.done = False


class StoreSim(Clients, Checks):
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.mcfg = MasterConfig(
            slice_limit=cfg.slice_limit,
            align=64,
            remount_quarantine=max(cfg.lease_ttl, cfg.put_timeout) * 1.5,
        )
        self.raft = RaftConfig(election_tick=10, heartbeat_tick=1, check_quorum=True, pre_vote=True)
        self.ids = [1, 2, 3]
        self.net = Network(self.ids, self.raft, seed=cfg.seed)
        self.sms = {i: StoreStateMachine(self.mcfg) for i in self.ids}
        self.consumed = dict.fromkeys(self.ids, 0)
        self.installed = dict.fromkeys(self.ids, 0)
        self.since_snap = dict.fromkeys(self.ids, 0)
        self.now = 0.0
        self.steps = 0
        self.queue: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = 0
        self.proposals: dict[int, _Proposal] = {}
        self.results: dict[int, int] = {}  # index -> term of the committed entry
        self.history = History(clock=lambda: self.now)
        self.res = SimResult(seed=cfg.seed, ok=True)
        # storage nodes: name -> alive; segment bytes: (segment, offset) -> tag
        self.nodes = {f"n{k}": True for k in range(cfg.n_nodes)}
        self.mounted: dict[str, bool] = dict.fromkeys(self.nodes, False)
        self.dmounted: dict[str, bool] = dict.fromkeys(self.nodes, False)  # disk segments
        self.demoting: set[tuple[str, int]] = set()  # demotions a node is copying
        self.promoting: set[tuple[int, str]] = set()  # promotions a node is copying
        self.demote_srcs: list[tuple[str, int, list[tuple[str, int]]]] = []  # their sources
        self.mem: dict[tuple[str, int], int] = {}
        self.reads: list[Read] = []
        self.read_ctx: dict[bytes, Callable[[int], None]] = {}
        # the leader's soft state and decisions: the production Leader (store/leader.py)
        self.lead = 0
        self.lead_term = 0
        self.lcfg = LeaderConfig(
            lease_ttl_s=cfg.lease_ttl,
            put_timeout_s=cfg.put_timeout,
            node_ttl_s=cfg.node_ttl,
            node_suspect_s=cfg.node_stage,
            ticker_s=0.25,  # _service_tick's period
            high_watermark=0.7,
            evict_ratio=0.2,
            demote_timeout_s=cfg.put_timeout,
            promote_hits=cfg.promote_hits,
        )
        self.ldr = Leader(self.lcfg, self.sms[1], self.now)
        self.term_keys: set[str] = set()  # keys put under this leader (a planted rule)
        self.evict_inflight = False
        # storage node -> when it died; the last time the leader's view was reset or it
        # could not commit (a dead node's expiry deadline counts from the later of the two)
        self.dead_since: dict[str, float] = {}
        self.calm_since = 0.0
        self._mount_seen: dict[str, tuple[int, float]] = {}  # segment -> (id, first seen)
        self.quiet_until = 0.0  # no heartbeat reaches the leader before (after a pause)
        self.keys = [f"k{i}" for i in range(cfg.n_keys)]
        self.tokens: dict[tuple[str, int], Any] = {}  # (key, version) -> the put's token
        self.incarn = dict.fromkeys(self.nodes, 0)  # storage node restarts
        self.seg_incarn: dict[str, int] = {}  # segment -> node incarnation that mounted it
        self.holds_pending = 0.0
        self.wall_off = {
            i: self.rng.uniform(-cfg.clock_skew, cfg.clock_skew) if cfg.clock_skew else 0.0
            for i in self.ids
        }

    def wall(self) -> float:
        """The current leader's wall clock (what it writes into commands as ``now``)."""
        return self.now + self.wall_off.get(self.lead, 0.0)

    # -------------------------------------------------------------------- plumbing

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (t, self.seq, fn))

    def leader(self) -> int:
        ls = [i for i in self.ids if self.net.nodes[i].core.role == Role.LEADER]
        if len(ls) != 1:
            return 0
        i = ls[0]
        core = self.net.nodes[i].core
        if core.log.zero_term(core.log.committed) != core.term:
            return 0  # not yet committed an entry of its term: soft state not ready
        return i

    def propose(self, cmd: Any, cb: Callable[[Any], None], timeout: float = 1.5) -> int:
        """Propose on the current leader; returns the entry index (0 if refused). Later
        ``cb(result)`` once applied somewhere, or ``cb(None)`` if the proposal was lost or
        timed out (outcome unknown)."""
        i = self.lead
        if not i:
            return 0
        try:
            idx = self.net.nodes[i].core.propose(encode_command(cmd))
        except (NotLeader, ProposalDropped):
            return 0
        self.proposals[idx] = _Proposal(self.net.nodes[i].core.term, cb, self.now + timeout)
        return idx

    def _on_applied(self, node: int, index: int, term: int, result: Any) -> None:
        if index in self.results:
            if self.results[index] != term:
                raise SimViolation(
                    f"log divergence at index {index}: terms {self.results[index]} and {term}"
                )
            return
        self.results[index] = term
        p = self.proposals.pop(index, None)
        if p is None or p.done:
            return
        p.done = True
        p.cb(result if p.term == term else None)

    def _apply_all(self) -> None:
        for i in self.ids:
            hn = self.net.nodes[i]
            sm = self.sms[i]
            if len(hn.installed) > self.installed[i]:
                snap = hn.installed[-1]
                self.installed[i] = len(hn.installed)
                if snap.meta.index > sm.applied:
                    sm.restore(snap.data)
                    self.res.snapshots_installed += 1
            ents = hn.applied
            while self.consumed[i] < len(ents):
                e = ents[self.consumed[i]]
                self.consumed[i] += 1
                if e.index <= sm.applied:
                    continue
                if e.kind != _NORMAL or not e.data:
                    sm.applied = e.index
                    continue
                if i == self.lead:
                    self.ldr.before_apply(e.index)
                try:
                    r = sm.apply(e.index, e.data)
                except Exception as ex:  # apply must never raise: a replica would stop
                    raise SimViolation(
                        f"replica {i}: apply of index {e.index} raised {ex!r}"
                    ) from ex
                self.res.entries = max(self.res.entries, e.index)
                self._on_applied(i, e.index, e.term, r)
                self.since_snap[i] += 1
            if self.cfg.snapshot_every and self.since_snap[i] >= self.cfg.snapshot_every:
                self._snapshot(i)
            for rs in hn.read_states:
                cb = self.read_ctx.pop(rs.context, None)
                if cb is not None:
                    cb(rs.index)
            hn.read_states.clear()

    def _snapshot(self, i: int) -> None:
        hn = self.net.nodes[i]
        sm = self.sms[i]
        st = hn.storage
        if sm.applied <= st.snapshot().meta.index or sm.applied > st.last_index():
            return
        st.create_snapshot(sm.applied, hn.core.conf_state, sm.snapshot())
        st.compact(max(st.first_index(), sm.applied - 5))
        self.since_snap[i] = 0

    def _restart(self, i: int) -> None:
        """Crash replica ``i``: its state machine restarts from its storage's snapshot."""
        self.net.restart(i)
        sm = StoreStateMachine(self.mcfg)
        snap = self.net.nodes[i].storage.snapshot()
        if snap.meta.index:
            sm.restore(snap.data)
        self.sms[i] = sm
        self.consumed[i] = 0
        self.installed[i] = 0
        self.res.restarts += 1

    # -------------------------------------------------------------------- leader service

    def _leader_change(self, new: int) -> None:
        self.lead = new
        if not new:
            return
        self.lead_term = self.net.nodes[new].core.term
        self.res.leader_changes += 1
        # As the service: the production Leader, elected with its last index + 1 as the
        # first entry of its own term.
        sm = self.sms[new]
        self.ldr = Leader(self.lcfg, sm, self.now)
        self.ldr.elected(
            self.now, self.net.nodes[new].core.log.last_index() + 1, lambda: sm.applied
        )
        self.term_keys = set()
        self.calm_since = self.now
        self.evict_inflight = False

    def _service_tick(self) -> None:
        if not self.lead:
            return
        sm = self.sms[self.lead]
        # A live node whose segment is not mounted (first start, or back after a crash and
        # after the leader expired its old segment) mounts it; refusals are retried.
        for n, alive in self.nodes.items():
            if alive and f"seg-{n}" not in sm.by_name and not self.mounted[n]:
                self.mounted[n] = True
                inc = self.incarn[n]

                def done(r: Any, n: str = n, inc: int = inc) -> None:
                    if r is None or r.codes[0] != 0:
                        self.mounted[n] = False
                    elif self.incarn[n] == inc:
                        self.seg_incarn[f"seg-{n}"] = inc

                if not self.propose(
                    Mount(n, f"seg-{n}", f"{n}:1", f"h{n}", self.cfg.segment_size, self.wall()),
                    done,
                ):
                    self.mounted[n] = False
        for n, alive in self.nodes.items():
            # the disk tier: a serving node mounts its disk segment too
            if (
                self.cfg.disk_size
                and alive
                and self._serving(n)
                and f"dsk-{n}" not in sm.by_name
                and not self.dmounted[n]
            ):
                self.dmounted[n] = True
                inc = self.incarn[n]

                def ddone(r: Any, n: str = n, inc: int = inc) -> None:
                    if r is None or r.codes[0] != 0:
                        self.dmounted[n] = False
                    elif self.incarn[n] == inc:
                        self.seg_incarn[f"dsk-{n}"] = inc

                cmd = Mount(
                    n, f"dsk-{n}", f"{n}:1", f"h{n}", self.cfg.disk_size, self.wall(), medium="disk"
                )
                if not self.propose(cmd, ddone):
                    self.dmounted[n] = False
        ld = self.ldr
        t0 = self.now
        self._check_liveness(sm, [])
        # The leader's proposals (Leader.tick), each proposed as it is decided; the results
        # come later (done then), so one tick may have several in flight, as in the service
        # when the log is slow.
        for cmd, done in ld.tick(self.now, self.wall(), evict=not self.evict_inflight):
            kind = type(cmd)
            if kind is ExpireNodes:
                self._check_liveness(sm, cmd.node_ids)
                self.propose(cmd, self._after(done, self._expired, t0))
            elif kind is Reclaim:
                self.propose(cmd, self._after(done, self._reclaimed, t0))
            elif kind is Release:
                self.propose(cmd, self._after(done, self._released, t0))
            elif kind is Evict:
                self._propose_evict(cmd, done)
            else:
                self.propose(cmd, self._after(done, None, t0))

    @staticmethod
    def _after(
        done: Callable[[Any], Any] | None, then: Callable[[Any, float], None] | None, t0: float
    ) -> Callable[[Any], None]:
        def cb(r: Any) -> None:
            if done is not None:
                done(r)
            if then is not None and r is not None:
                then(r, t0)

        return cb

    def _expired(self, r: Any, t0: float) -> None:
        self.res.expiries += 1
        for k in r.lost:
            h = self.history.invoke("sys", StoreOp("drop", k), t=t0)
            self.history.ok(h, "ok")

    def _reclaimed(self, r: Any, t0: float) -> None:
        for k in r.lost:
            h = self.history.invoke("sys", StoreOp("drop", k), t=t0)
            self.history.ok(h, "ok")
        # A node that left gracefully exits once its drained segment is dropped.
        for seg in r.unmounted:
            n = seg[4:]
            if self.nodes.get(n) and self.seg_incarn.get(seg) == self.incarn[n]:
                self._kill_node(n)
                self.res.drains += 1

    def _released(self, r: Any, t0: float) -> None:
        self.res.holds_released += sum(1 for c in r.codes if c == 0)

    def _maybe_evict(self, need: int) -> None:
        if not self.lead or self.evict_inflight:
            return
        ld = self.ldr
        cmd = ld.eviction(self.now, self.wall(), need)
        if cmd is not None:
            self._propose_evict(cmd, lambda r: ld.evicted(cmd, r))

    def _propose_evict(self, cmd: Evict, done: Callable[[Any], Any]) -> None:
        self._count_exempt(cmd.keys)
        t0 = self.now
        keys = cmd.keys

        def evicted(r: Any) -> None:
            done(r)
            self.evict_inflight = False
            if r is None:
                for k in keys:
                    h = self.history.invoke("sys", StoreOp("drop", k), t=t0)
                    self.history.info(h)
                return
            self.res.evictions += sum(1 for c in r.codes if c == 0)
            for k, c in zip(keys, r.codes):
                if c == 0:
                    h = self.history.invoke("sys", StoreOp("drop", k), t=t0)
                    self.history.ok(h, "ok")

        if self.propose(cmd, evicted):
            self.evict_inflight = True
        else:
            done(None)

    def _count_exempt(self, keys: list[str], unheld: bool = True) -> None:
        """Count keys of an existing object freed or rewritten during the grace period
        (the keys TermStart found fresh: before, every such request waited it out)."""
        if self.now < self.ldr.leases.blanket_until and unheld and self.lead:
            sm = self.sms[self.lead]
            self.res.grace_exempt += sum(1 for k in keys if sm.version_of(k))

    # -------------------------------------------------------------------- storage nodes

    def _heartbeats(self) -> None:
        """Only a node serving its current segment heartbeats: a restarted node stays
        silent until the leader expired its old segment and it mounted a new one."""
        for n, alive in self.nodes.items():
            if alive and self.lead and self._serving(n) and self.now >= self.quiet_until:
                self.ldr.heartbeat(n, self.now)
                self.dead_since.pop(n, None)
                if self.cfg.disk_size and self.seg_incarn.get(f"dsk-{n}") == self.incarn[n]:
                    self._promote(n, self.ldr.tiers.promote_tasks(n, 8))
                    tasks = self.ldr.tiers.demote_tasks(n, 8)
                    if tasks:
                        self._demote(n, tasks)
                        continue
                    # none: the handler proposes the next batch if one is due (the node's
                    # next poll finds it)
                    for c, d in self.ldr.tiers.demote_asked(self.now, self.wall()):
                        if not self.propose(c, d):
                            d(None)

    def _demote(self, n: str, tasks: list[Any]) -> None:
        """A node's demotions (tiercopy.py's): read each memory copy's bytes, write them into
        its disk copy, and -- the copy and the fdatasync taking a while -- end them with the
        checksum of the bytes written. It never checks what it read: the master's rules
        must make that the object's bytes."""
        inc = self.incarn[n]
        todo = [t for t in tasks if (t.key, t.version) not in self.demoting]
        self.demoting.update((t.key, t.version) for t in todo)
        if not todo:
            return
        # while the node copies, the memory copy it reads must stay the object's (checked
        # every step, as the bytes under a read lease are)
        srcs = [(t.key, t.version, [(d.segment, d.offset) for d in t.src.slices]) for t in todo]
        self.demote_srcs.extend(srcs)

        def end() -> None:
            for x in srcs:
                self.demote_srcs.remove(x)
            # the copy ran meanwhile: what it read is what the memory holds by now
            ends: list[tuple[str, int, int]] = []
            for t in todo:
                if not all(
                    self.seg_incarn.get(d.segment) == self.incarn[d.segment[4:]]
                    for d in t.src.slices
                ):
                    continue  # a copy on a node that went: the read failed
                got = [self.mem.get((d.segment, d.offset)) for d in t.src.slices]
                for d, tag in zip(t.dst.slices, got):
                    self.mem[(d.segment, d.offset)] = tag
                ends.append((t.key, t.version, zlib.crc32(repr(got).encode())))

            cmd = DemoteEnd(
                n, [k for k, _, _ in ends], [v for _, v, _ in ends], [c for _, _, c in ends]
            )

            def done(r: Any) -> None:
                for t in todo:
                    self.demoting.discard((t.key, t.version))
                if r is None:
                    return
                self.res.demotions += sum(1 for c in r.codes if c == 0)
                # the handler's chain (Tiering.demote_ended), then the reply's tasks
                chain = (
                    self.ldr.tiers.demote_ended(cmd, r, self.now, self.wall()) if self.lead else []
                )
                left = [len(chain)]

                def replied() -> None:
                    if self.lead and self.nodes[n] and self.incarn[n] == inc:
                        self._demote(n, self.ldr.tiers.demote_tasks(n, 8))

                def one(res: Any, d: Callable[[Any], Any]) -> None:
                    d(res)
                    left[0] -= 1
                    if not left[0]:
                        replied()

                for c, d in chain:
                    if not self.propose(c, lambda res, d=d: one(res, d)):
                        one(None, d)
                if not chain:
                    replied()

            if (
                not ends
                or not (self.nodes[n] and self.incarn[n] == inc)
                or not self.propose(cmd, done)
            ):
                done(None)

        self.at(self.now + self.rng.uniform(0.02, 0.3), end)

    def _promote(self, n: str, tasks: list[Any]) -> None:
        """A node's promotions (tiercopy.py's): read each disk copy, check it against its crc,
        write it into the reserved memory a while later, then end them. What it writes
        lands where the master reserved: the reservation must outlive the copy."""
        inc = self.incarn[n]
        todo = [t for t in tasks if (t.tag, t.key) not in self.promoting]
        if not todo:
            return
        self.promoting.update((t.tag, t.key) for t in todo)
        got = {t.key: self.mem.get((t.src.slices[0].segment, t.src.slices[0].offset)) for t in todo}

        def end() -> None:
            for t in todo:
                self.promoting.discard((t.tag, t.key))
            if not (self.nodes[n] and self.incarn[n] == inc):
                return
            ok = [t for t in todo if zlib.crc32(repr([got[t.key]]).encode()) == t.crc]
            for t in ok:
                d = t.dst.slices[0]
                if self.seg_incarn.get(d.segment) == inc:
                    self.mem[(d.segment, d.offset)] = got[t.key]
            for tag in {t.tag for t in ok}:
                ts = [t for t in ok if t.tag == tag]
                cmd = PromoteEnd(
                    n, tag, [t.key for t in ts], [t.version for t in ts],
                    [t.dst.slices[0].segment for t in ts], [t.dst.slices[0].offset for t in ts],
                )  # fmt: skip

                def done(r: Any, cmd: PromoteEnd = cmd) -> None:
                    if r is not None:
                        self.res.promotions += sum(1 for c in r.codes if c == 0)
                    if self.lead:
                        self.ldr.tiers.promote_ended(cmd, r)

                if not self.lead:
                    continue
                cmd = self.ldr.tiers.plan_promote_end(cmd)  # the handler's check
                if not cmd.keys or not self.propose(cmd, lambda r, cmd=cmd: done(r, cmd)):
                    done(None, cmd)

        self.at(self.now + self.rng.uniform(0.02, 0.3), end)

    def _serving(self, n: str) -> bool:
        return self.nodes[n] and self.seg_incarn.get(f"seg-{n}") == self.incarn[n]

    def _kill_node(self, n: str) -> None:
        if self._serving(n):
            self.dead_since.setdefault(n, self.now)
        self.nodes[n] = False
        self.mounted[n] = False
        self.incarn[n] += 1
        self.dmounted[n] = False
        seg = f"seg-{n}"
        for k in [k for k in self.mem if k[0] == seg]:
            del self.mem[k]  # (its disk bytes stay: the file outlives the process)
        self.at(self.now + self.rng.uniform(2.0, 5.0), lambda: self.nodes.__setitem__(n, True))

    # -------------------------------------------------------------------- clients

    def run(self) -> SimResult:
        cfg = self.cfg
        self.net.elect(1)
        for c in range(cfg.n_clients):
            self.at(0.5 + 0.05 * c, lambda c=c: self._client(c))
        next_fault = 3.0
        next_pause = 2.5 if cfg.pause else float("inf")
        healed_at = None
        with planted(cfg.plant, self):
            try:
                while self.now < cfg.duration:
                    self.steps += 1
                    self.now += cfg.step
                    if self.steps % cfg.tick_every == 0:
                        for node in self.net.nodes.values():
                            node.core.tick()
                    self.net.deliver_once()
                    self._apply_all()
                    lead = self.leader()
                    if lead != self.lead or (
                        lead and self.net.nodes[lead].core.term != self.lead_term
                    ):
                        self._leader_change(lead)
                    if self.steps % 20 == 0:
                        self._heartbeats()
                    if self.steps % 25 == 0:
                        self._service_tick()
                    for idx, p in list(self.proposals.items()):
                        if self.now > p.deadline and not p.done:
                            p.done = True
                            del self.proposals[idx]
                            p.cb(None)
                    while self.queue and self.queue[0][0] <= self.now:
                        _, _, fn = heapq.heappop(self.queue)
                        fn()
                    if cfg.faults and self.now >= next_fault:
                        next_fault = self.now + self.rng.uniform(2.0, 5.0)
                        healed_at = self._fault()
                    if self.now >= next_pause:
                        self._pause()
                        next_pause = self.now + self.rng.uniform(2.0, 4.0)
                    if healed_at is not None and self.now >= healed_at:
                        self.net.recover()
                        self.calm_since = self.now
                        healed_at = None
                    self._check()
                self._final_audit()
            except SimViolation as e:
                self.res.ok = False
                self.res.violation = str(e)
                return self.res
        ops = self.history.operations()
        self.res.ops_ok = sum(1 for o in ops if not o.pending)
        self.res.ops_unknown = sum(1 for o in ops if o.pending)
        # a step budget, not a time budget: the outcome must not depend on machine load
        lin = check(StoreModel(), ops, timeout_s=None, max_steps_per_partition=5_000_000)
        self.res.lin_outcome = lin.outcome
        if lin.outcome == "illegal":
            self.res.ok = False
            self.res.violation = lin.report(max_ops=30)
        return self.res

    def _fault(self) -> float | None:
        if self.cfg.clock_skew and self.rng.random() < 0.5:
            # a wall clock steps (NTP correction, VM resume): a replica's offset changes
            i = self.rng.choice(self.ids)
            self.wall_off[i] = self.rng.uniform(-self.cfg.clock_skew, self.cfg.clock_skew)
        r = self.rng.random()
        if r < 0.3 and self.lead:
            self.net.isolate(self.lead)
            self.res.isolations += 1
            self.calm_since = self.now
            return self.now + self.rng.uniform(1.0, 4.0)
        if r < 0.45:
            self._restart(self.rng.choice(self.ids))
            return None
        if r < 0.65:
            alive = [n for n, a in self.nodes.items() if a]
            if len(alive) > 1:
                self._kill_node(self.rng.choice(alive))
                self.res.node_kills += 1
            return None
        if r < 0.9:  # a storage node leaves gracefully: drain, then exit
            serving = [n for n in self.nodes if self._serving(n)]
            if len(serving) > 1:
                n = self.rng.choice(serving)
                self.propose(
                    Unmount(n, f"seg-{n}", self.wall(), self.cfg.lease_ttl * 2), lambda r: None
                )
            return None
        if self.lead:
            # A leadership transfer: the new leader leads within a few ticks, while reads
            # under the old leader's leases are still copying (an isolation takes longer
            # than a lease to elect anyone, so only this tests the new leader's grace).
            to = self.rng.choice([i for i in self.ids if i != self.lead])
            try:
                self.net.nodes[self.lead].core.transfer_leader(to)
                self.res.transfers += 1
            except ReplogError:
                pass
        return None

    def _pause(self) -> None:
        """A host-wide pause (VM migration, memory pressure): every replica stops at
        once and resumes with its clocks moved on; nothing it would have heard (the
        nodes' heartbeats meanwhile) arrives, and nobody was elected meanwhile. The
        nodes' calls timed out: their next heartbeats come a little after the resume
        (reconnect, next interval), while the leader's ticker runs at once."""
        self.now += self.cfg.pause
        self.quiet_until = self.now + self.rng.uniform(0.3, 0.6)
        self.res.pauses += 1
        self.calm_since = self.now
