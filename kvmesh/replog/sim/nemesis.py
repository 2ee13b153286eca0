"""Random fault schedule: fault periods (1-2 faults at once, biased towards the leader)
alternating with stable periods of at least 3 x the maximum election timeout.

Besides generic faults, three schedules aim at situations that random faults reach only
rarely, so that the CI seeds exercise them (and the mutation suite can show they matter):

* ``stale_snapshot``: a follower is cut off while the leader snapshots and compacts, so it
  is caught up by InstallSnapshot; the network then delivers a delayed duplicate of that
  snapshot after the follower has moved on (and taken a snapshot of its own): the follower
  must refuse it.
* ``figure8``: no acknowledgement reaches the leader, so its entries stay uncommitted
  until it steps down, and the next leader's disk is slow: a quorum then holds entries of
  an older term but not yet the new leader's no-op, and they must not be committed by
  counting replicas (paper Figure 8).
* ``vote_suppression``: the leader and one follower cannot hear each other while both hear
  the rest, and clients only read (so the follower's log stays up to date): the follower
  campaigns, and voters that hear a live leader must ignore it (thesis §4.2.3; with
  leases, a new leader while the old lease is valid is a violation).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from ..storage.memory import MemoryStorage
from ..types import (
    ConfChange,
    ConfChangeError,
    ConfChangeType,
    LeaderTransferError,
    NotLeader,
    ProposalDropped,
    Role,
)
from .network import NetParams

__all__ = ["FAULTS", "Nemesis"]

# name -> weight
FAULTS: dict[str, int] = {
    "partition": 3,
    "isolate_leader": 3,
    "isolate": 2,
    "one_way": 2,
    "bridge": 2,
    "loss": 2,
    "dup_reorder": 2,
    "slow_node": 1,
    "crash": 3,
    "crash_leader": 3,
    "crash_all": 2,
    "pause": 2,
    "clock": 1,
    "membership": 2,
    "transfer": 1,
    "snapshot": 1,
    "stale_snapshot": 2,
    "figure8": 2,
    "vote_suppression": 2,
}

Undo = Callable[[], None]


class Nemesis:
    def __init__(self, sim, rng: random.Random, faults: tuple[str, ...] = ()) -> None:
        self.sim = sim
        self.rng = rng
        names = list(faults) if faults else list(FAULTS)
        unknown = [n for n in names if n not in FAULTS]
        if unknown:
            raise ValueError(f"unknown faults {unknown}; known: {sorted(FAULTS)}")
        self.names = names
        self.weights = [FAULTS[n] for n in names]
        self.active: list[Undo] = []
        self.stopped = False
        self.stable_since: float | None = 0.0  # start of the current stable window

    # -- schedule ----------------------------------------------------------------------------

    def start(self) -> None:
        self.sim.schedule(self._stable_period() * 0.5, self._fault_on)

    def stop(self) -> None:
        self.stopped = True
        self._undo_all()

    def _stable_period(self) -> float:
        return 3 * self.sim.cfg.election_max_s * self.rng.uniform(1.0, 1.5)

    def _fault_on(self) -> None:
        if self.stopped:
            return
        sim = self.sim
        self.stable_since = None
        k = 1 if self.rng.random() < 0.6 else min(2, sim.cfg.max_concurrent_faults)
        for name in self.rng.choices(self.names, self.weights, k=k):
            undo = getattr(self, "_f_" + name)()
            sim.faults_applied.append(name)
            sim.log_event("fault", 0, name)
            if undo is not None:
                self.active.append(undo)
        dur = self.rng.uniform(sim.cfg.fault_min, sim.cfg.fault_max)
        sim.schedule(dur, self._fault_off)

    def _fault_off(self) -> None:
        self._undo_all()
        self.stable_since = self.sim.now
        if not self.stopped:
            self.sim.log_event("heal", 0, "")
            self.sim.schedule(self._stable_period(), self._fault_on)

    def _undo_all(self) -> None:
        active, self.active = self.active, []
        for undo in reversed(active):
            undo()

    # -- helpers -------------------------------------------------------------------------------

    def _members(self) -> list[int]:
        return self.sim.member_ids()

    def _leader_or_random(self) -> int:
        lid = self.sim.leader_id()
        if lid is not None and self.rng.random() < 0.8:
            return lid
        return self.rng.choice(self._members())

    def _cut(self, pairs: list[tuple[int, int]]) -> Undo:
        net = self.sim.net
        added = [p for p in pairs if p not in net.cut]
        net.cut.update(added)

        def undo() -> None:
            for p in added:
                net.cut.discard(p)

        return undo

    def _links(self, params: dict[tuple[int, int], NetParams]) -> Undo:
        net = self.sim.net
        old = {k: net.links.get(k) for k in params}
        net.links.update(params)

        def undo() -> None:
            for k, v in old.items():
                if v is None:
                    net.links.pop(k, None)
                else:
                    net.links[k] = v

        return undo

    def _all_ids(self) -> list[int]:
        return sorted(self.sim.nodes)

    # -- faults -------------------------------------------------------------------------------

    def _f_partition(self) -> Undo:
        ids = self._members()
        self.rng.shuffle(ids)
        k = self.rng.randint(1, max(1, len(ids) // 2))
        a, b = set(ids[:k]), set(ids[k:])
        pairs = [
            (x, y)
            for x in self._all_ids()
            for y in self._all_ids()
            if x != y and ((x in a) != (y in a) or x not in a | b or y not in a | b)
        ]
        return self._cut(pairs)

    def _isolate(self, n: int) -> Undo:
        pairs = [p for m in self._all_ids() if m != n for p in ((n, m), (m, n))]
        return self._cut(pairs)

    def _f_isolate_leader(self) -> Undo:
        return self._isolate(self._leader_or_random())

    def _f_isolate(self) -> Undo:
        return self._isolate(self.rng.choice(self._members()))

    def _f_one_way(self) -> Undo:
        # The leader's outbound links work, its inbound ones drop everything (A6).
        n = self._leader_or_random()
        return self._cut([(m, n) for m in self._all_ids() if m != n])

    def _f_bridge(self) -> Undo:
        # Non-transitive: the leader reaches only one bridge node, which reaches everyone (A7).
        a = self._leader_or_random()
        others = [m for m in self._members() if m != a]
        if not others:
            return self._cut([])
        b = self.rng.choice(others)
        pairs = [p for c in self._all_ids() if c not in (a, b) for p in ((a, c), (c, a))]
        return self._cut(pairs)

    def _f_loss(self) -> Undo:
        net = self.sim.net
        old = net.default
        p = self.rng.choice((0.01, 0.1, 0.3))
        net.default = NetParams(p, old.dup, old.delay, old.jitter)

        def undo() -> None:
            net.default = old

        return undo

    def _f_dup_reorder(self) -> Undo:
        net = self.sim.net
        old = net.default
        net.default = NetParams(old.loss, 0.2, old.delay, max(old.jitter * 20, 0.02))

        def undo() -> None:
            net.default = old

        return undo

    def _f_slow_node(self) -> Undo:
        n = self.rng.choice(self._members())
        d = self.sim.net.default
        slow = NetParams(d.loss, d.dup, d.delay * 10 + 0.01, d.jitter * 10)
        params = {}
        for m in self._all_ids():
            if m != n:
                params[(n, m)] = slow
                params[(m, n)] = slow
        return self._links(params)

    def _crash_then_restart(self, ids: list[int], downtime: float | None = None) -> Undo:
        sim = self.sim
        crashed = [i for i in ids if sim.nodes[i].alive]
        for i in crashed:
            sim.crash(i)

        def undo() -> None:
            for i in crashed:
                if not sim.nodes[i].alive:
                    sim.restart(i)

        if downtime is not None:
            sim.schedule(downtime, undo)
        return undo

    def _f_crash(self) -> Undo:
        return self._crash_then_restart([self.rng.choice(self._members())])

    def _f_crash_leader(self) -> Undo:
        return self._crash_then_restart([self._leader_or_random()])

    def _f_crash_all(self) -> Undo:
        # Correlated crash (power loss): every node loses its unsynced writes (C2).
        return self._crash_then_restart(self._members(), downtime=self.rng.uniform(0.05, 1.0))

    def _f_pause(self) -> Undo:
        sim = self.sim
        n = self._leader_or_random()
        node = sim.nodes[n]
        node.pause()

        def undo() -> None:
            node.resume()

        return undo

    def _f_clock(self) -> Undo:
        sim = self.sim
        n = self._leader_or_random()
        node = sim.nodes[n]
        d = sim.cfg.clock_drift
        if d >= 0.5:
            node.drift = self.rng.choice((0.5, 2.0))
        else:
            node.drift = 1.0 + self.rng.uniform(-d, d)

        def undo() -> None:
            node.drift = 1.0

        return undo

    def _f_membership(self) -> None:
        sim = self.sim
        lid = sim.leader_id()
        if lid is None:
            return None
        leader = sim.nodes[lid]
        core = leader.core
        new_node = None
        try:
            if core.learners:
                n = core.learners[0]
                pr = core.prs.get(n)
                if pr is None or pr.match + 20 < core.log.committed:
                    return None  # not caught up yet
                core.propose_conf_change(ConfChange(int(ConfChangeType.PROMOTE_LEARNER), n))
            elif len(core.voters) > sim.cfg.n_voters:
                victim = self.rng.choice(core.voters)
                core.propose_conf_change(ConfChange(int(ConfChangeType.REMOVE_NODE), victim))
            else:
                new_id = sim.next_node_id
                sim.next_node_id += 1
                new_node = sim.add_node(new_id, MemoryStorage())
                core.propose_conf_change(ConfChange(int(ConfChangeType.ADD_LEARNER), new_id))
        except (ProposalDropped, ConfChangeError, NotLeader):
            if new_node is not None:
                new_node.removed = True
            return None
        if sim.inv.uncommitted_conf_changes(core) > 1:
            from .invariants import SimViolation

            raise SimViolation(
                "configuration",
                f"leader {lid} holds more than one uncommitted configuration change",
            )
        leader.pump()
        return None

    def _f_transfer(self) -> None:
        sim = self.sim
        lid = sim.leader_id()
        if lid is None:
            return None
        core = sim.nodes[lid].core
        targets = [v for v in core.voters if v != lid]
        if targets:
            try:
                core.transfer_leader(self.rng.choice(targets))
            except (LeaderTransferError, NotLeader):
                pass
            sim.nodes[lid].pump()
        return None

    def _f_snapshot(self) -> None:
        node = self.sim.nodes[self.rng.choice(self._members())]
        # Also between two apply slices of a Ready (the path's applied point is consistent).
        if node.alive and not node.paused:
            node.take_snapshot()
        return None

    def _f_stale_snapshot(self) -> Undo:
        sim = self.sim
        lid = sim.leader_id()
        followers = [m for m in self._members() if m != lid and sim.nodes[m].alive]
        if lid is None or not followers:
            return self._cut([])
        f = self.rng.choice(followers)
        undo_cut = self._isolate(f)
        leader = sim.nodes[lid]

        def compact() -> None:
            # The leader snapshots and compacts past what the follower has.
            if leader.alive and not leader.paused and leader.core.role == Role.LEADER:
                leader.take_snapshot()

        leader.take_snapshot()
        sim.schedule(self.rng.uniform(0.3, 0.8), compact)
        sim.replay_snapshots[f] = self.rng.uniform(0.5, 2.5)

        def undo() -> None:
            undo_cut()
            # Keep replaying for a while after the heal: that is when the snapshot is sent.
            sim.schedule(3.0, sim.replay_snapshots.pop, f, None)

        return undo

    def _f_figure8(self) -> Undo:
        sim = self.sim
        lid = sim.leader_id()
        others = [m for m in self._members() if m != lid]
        if lid is None or len(others) < 2:
            return self._cut([])
        # The leader's appends reach everyone but no answer reaches it: entries of its term
        # pile up uncommitted on every replica until it steps down (check-quorum). All but
        # one of the others get a slow disk: when one of them wins the election, its own
        # no-op is not yet durable when the fast follower acknowledges it, so a quorum holds
        # the older-term entries only (paper Figure 8: they must not be committed by
        # counting; the no-op commits them).
        fast = self.rng.choice(others)
        slow = [sim.nodes[m] for m in others if m != fast]
        for n in slow:
            n.fsync_factor = 30.0
        undo_cut = self._cut([(m, lid) for m in self._all_ids() if m != lid])

        def undo() -> None:
            undo_cut()
            for n in slow:
                n.fsync_factor = 1.0

        return undo

    def _f_vote_suppression(self) -> Undo:
        sim = self.sim
        lid = sim.leader_id()
        others = [m for m in self._members() if m != lid]
        if lid is None or not others:
            return self._cut([])
        # A quiet cluster (clients only read), so the cut-off follower's log stays as
        # up to date as everyone's: only vote suppression keeps it from winning while the
        # leader is alive and reachable by the others.
        f = self.rng.choice(others)
        sim.quiet = True
        undo_cut = self._cut([(lid, f), (f, lid)])

        def undo() -> None:
            undo_cut()
            sim.quiet = False

        return undo
