"""Deterministic simulation of the store master on the real Raft core, with store invariants.

Three master replicas (``kvmesh.replog`` cores on the hand-driven
:class:`~kvmesh.replog.sim.harness.Network`) each apply the committed log to their own
:class:`~.state.StoreStateMachine`. A virtual clock drives:

* the production leader (:class:`~kvmesh.store.leader.Leader`, the service's own soft state
  and decisions: leases and the new leader's grace, access order, node liveness, what each
  tick proposes, remove/upsert planning, eviction), driven as the service drives it: it
  mounts segments, expires silent storage nodes, reclaims stale puts, releases holds and
  evicts above the watermark;
* storage nodes whose segment bytes are modelled as one tag per slice (a checksum of key,
  version and slice number); a node that dies loses its bytes and comes back later;
* clients doing two-phase puts (write tags, then PutEnd; some soft- or hard-pinned), upserts,
  reads (read index, lookup, lease, a copy that takes time, then a byte check), exists,
  removes (sometimes forced) and removes by prefix (one round: the leader's scan, then one
  ``RemovePrefix`` entry);
* clocks: every replica has its own wall clock (``clock_skew``: offsets up to that many
  seconds either way, which also jump at fault time); commands carry the proposing
  leader's wall clock, leases and put ages run on the (monotonic) virtual clock;
* faults: leader isolation, replica restarts (state machine rebuilt from the storage's
  snapshot + log), snapshots with log compaction, storage nodes that die (and come back with a
  new segment once the old one expired) or leave gracefully (drain, then exit).

Checked on every step (:class:`SimViolation` names the first failure):

* :func:`~.invariants.check` on every replica (no overlapping live copies, allocator
  accounting, coalescing, distinct nodes per object, indexes);
* every read lease in force: its bytes still belong to that object version (never freed,
  reallocated or moved);
* every completed read returned exactly the bytes of the version it looked up;
* replicas that applied the same prefix have the same state digest.

At the end the network heals, every key is read through the leader (bytes checked), and the
put/get/exists/remove/evict history goes through :func:`kvmesh.replog.sim.linearizability.check`
with :class:`StoreModel`.

Negative controls (``plant``), each a bug planted in the real state machine or the real
leader for the run, must be caught: in the state machine ``"double_free"`` (Release frees a
hold but keeps it, so the leader releases it again) and ``"lost_put"`` (PutEnd acknowledges
puts it does not publish); in the leader ``"lease_ignored"`` (eviction ignores read leases),
``"prefix_lease_ignored"`` (a remove by prefix that ignores them), ``"no_grace"`` (a new
leader skips the grace period for its predecessors' leases), ``"fresh_by_key"`` (an
over-narrow grace: "put under this leader" judged by key name, not by
:class:`~.leases.TermStart`'s versions), ``"wall_reclaim"`` (stale puts reclaimed by the
wall-clock ``Reclaim`` cutoff, the old rule: with ``clock_skew`` a leader whose clock runs
ahead frees memory a writer is still writing) and ``"stale_alive"`` (every node judged alive
at each tick, whatever its last heartbeat); in the liveness judge ``"raw_gap"`` (liveness
judged on the raw clock gap, with ``pause``: a paused leader expires the nodes that kept
heartbeating). Node liveness: a serving node (it heartbeats) is never expired; a dead one
is expired within TTL + two stages + 1 s of a calm leader.
``python -m kvmesh.store.master.sim --seeds 50`` runs a batch.
"""

from __future__ import annotations

import heapq
import random
import zlib
from collections.abc import Callable, Hashable, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import msgspec

from ...replog import (
    UNKNOWN,
    EntryKind,
    History,
    NotLeader,
    Operation,
    ProposalDropped,
    RaftConfig,
    ReplogError,
    Role,
    check,
)
from ...replog.sim.harness import Network
from ..errors import Code
from ..leader import Leader, LeaderConfig
from ..types import ReplicateConfig
from . import state as state_mod
from .commands import (
    Evict,
    ExpireNodes,
    Mount,
    PutEnd,
    PutRevoke,
    PutStart,
    Reclaim,
    Release,
    Unmount,
    Upsert,
    encode_command,
)
from .invariants import check as check_state
from .invariants import extents
from .leases import LeaseTable
from .liveness import LivenessJudge
from .policy import plan_remove_prefix
from .state import MasterConfig, StoreStateMachine

__all__ = [
    "StoreOp",
    "StoreModel",
    "SimConfig",
    "SimResult",
    "SimViolation",
    "StoreSim",
    "run_seed",
]

_NORMAL = int(EntryKind.NORMAL)


class SimViolation(Exception):
    pass


# ======================================================================================
# The sequential model


class StoreOp(NamedTuple):
    """``op`` in put/hide/get/exists/remove/drop; ``value`` is the put's unique token."""

    op: str
    key: str
    value: Hashable = None


class StoreModel:
    """Per-key register with Mooncake put semantics (state: the visible token or None).

    Outputs: put ``ok`` (only if absent) / ``exists`` (only if present) / ``busy`` (another put
    in flight: no effect, any state); ``hide`` (an upsert's start: the old value becomes
    invisible until the upsert's ``put`` completes) ``ok`` / ``busy`` / ``leased``; get:
    the token or None; exists: bool; remove ``ok`` (present) / ``notfound`` (absent) /
    ``leased`` / ``busy``; drop (eviction or loss of the last copy) ``ok`` only if present;
    prune (a key a remove-by-prefix entry named: removed if COMPLETE, else already absent
    or being put) always legal, leaves the key absent.
    """

    def init(self) -> Any:
        return None

    def step(self, state: Any, inp: StoreOp, out: Any) -> tuple[bool, Any]:
        op = inp.op
        unknown = out is UNKNOWN
        if op == "put":
            if unknown:
                return True, (inp.value if state is None else state)
            if out == "ok":
                return state is None, inp.value
            if out == "exists":
                return state is not None, state
            return out == "busy", state
        if op == "hide":  # the first half of an upsert: the key turns PROCESSING
            if unknown or out == "ok":
                return True, None
            return out in ("busy", "leased"), state
        if op == "get":
            return unknown or out == state, state
        if op == "exists":
            return unknown or out == (state is not None), state
        if op == "remove":
            if unknown:
                return True, None
            if out == "ok":
                return state is not None, None
            if out == "notfound":
                return state is None, state
            return out in ("leased", "busy"), state
        if op == "drop":
            return unknown or state is not None, None
        if op == "prune":
            return True, None
        raise ValueError(op)

    def partition(self, ops: Sequence[Operation]) -> list[list[Operation]]:
        by: dict[str, list[Operation]] = {}
        for o in ops:
            by.setdefault(o.input.key, []).append(o)
        return list(by.values())

    def partition_name(self, ops: Sequence[Operation]) -> str:
        return f"key={ops[0].input.key!r}" if ops else "empty"

    def is_read_only(self, inp: StoreOp) -> bool:
        return inp.op in ("get", "exists")

    def describe_operation(self, inp: StoreOp, out: Any) -> str:
        return (
            f"{inp.op}({inp.key!r}{'' if inp.value is None else ', ' + repr(inp.value)}) -> {out!r}"
        )

    def describe_state(self, state: Any) -> str:
        return repr(state)


# ======================================================================================
# Configuration and result


class SimConfig(msgspec.Struct, kw_only=True):
    seed: int = 0
    duration: float = 20.0  # virtual seconds
    step: float = 0.01
    tick_every: int = 10  # steps per Raft tick
    n_clients: int = 4
    n_keys: int = 10
    n_nodes: int = 3
    segment_size: int = 2048
    slice_limit: int = 256
    lease_ttl: float = 0.5
    put_timeout: float = 2.0
    node_ttl: float = 1.5
    node_stage: float = 0.5  # the liveness judge's suspect stage (master/liveness.py)
    # host-wide pauses (every replica stopped at once, the storage nodes not) of this many
    # seconds among the faults; 0: none
    pause: float = 0.0
    faults: bool = True
    snapshot_every: int = 15
    clock_skew: float = 0.0  # max wall-clock offset of a replica, seconds (either way)
    plant: str | None = None


class SimResult(msgspec.Struct, kw_only=True):
    seed: int
    ok: bool
    violation: str = ""
    ops_ok: int = 0
    ops_unknown: int = 0
    entries: int = 0
    leader_changes: int = 0
    restarts: int = 0
    evictions: int = 0
    expiries: int = 0
    reads_checked: int = 0
    lease_expired_reads: int = 0
    holds_released: int = 0
    isolations: int = 0
    drains: int = 0
    snapshots_installed: int = 0
    node_kills: int = 0
    prefix_removes: int = 0
    transfers: int = 0  # leadership transfers
    grace_exempt: int = 0  # removes/upserts/evictions in a grace period of fresh keys
    pauses: int = 0
    lin_outcome: str = ""


def _tag(key: str, version: int, i: int) -> int:
    return zlib.crc32(b"%s\0%d\0%d" % (key.encode(), version, i))


class _Proposal:
    __slots__ = ("term", "cb", "deadline", "done")

    def __init__(self, term: int, cb: Callable[[Any], None], deadline: float) -> None:
        self.term = term
        self.cb = cb
        self.deadline = deadline
        self.done = False


class _Read:
    """A read in progress: the copy runs under a lease until ``finish``."""

    __slots__ = ("key", "version", "slices", "until", "op", "incs")

    def __init__(
        self, key: str, version: int, slices: list[tuple[str, int, int]], until: float, op: int
    ) -> None:
        self.key = key
        self.version = version
        self.slices = slices  # (segment, offset, slice number)
        self.until = until
        self.op = op


# ======================================================================================
# The simulator


class StoreSim:
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
        self.mem: dict[tuple[str, int], int] = {}
        self.reads: list[_Read] = []
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

    def _check_liveness(self, sm: StoreStateMachine, expiring: list[str]) -> None:
        """The liveness judge's two promises: never expire a node that heartbeats (every
        serving node does, whenever there is a leader), and expire a dead one within TTL +
        one stage per earlier bounded round (two nodes at most die together here) + slack
        for ticks and the commit, counted from its death or the last time the leader's
        view was reset or it could not commit, whichever is later."""
        for n in expiring:
            if self._serving(n):
                raise SimViolation(f"the leader expires storage node {n}, which heartbeats")
        bound = self.cfg.node_ttl + 2 * self.cfg.node_stage + 1.0
        for n, t in self.dead_since.items():
            seg = f"seg-{n}"
            sid = sm.by_name.get(seg)
            if sid is None:
                continue
            # A Mount the node proposed before it died can commit after its death (or after
            # its expiry): the judge then first hears of it, so its TTL runs from there.
            seen = self._mount_seen.get(seg)
            if seen is None or seen[0] != sid:
                seen = self._mount_seen[seg] = (sid, self.now)
            if self.now - max(t, self.calm_since, seen[1]) > bound:
                raise SimViolation(
                    f"storage node {n} died at {t:.2f} and is still mounted at {self.now:.2f}"
                )

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

    def _serving(self, n: str) -> bool:
        return self.nodes[n] and self.seg_incarn.get(f"seg-{n}") == self.incarn[n]

    def _kill_node(self, n: str) -> None:
        if self._serving(n):
            self.dead_since.setdefault(n, self.now)
        self.nodes[n] = False
        self.mounted[n] = False
        self.incarn[n] += 1
        seg = f"seg-{n}"
        for k in [k for k in self.mem if k[0] == seg]:
            del self.mem[k]
        self.at(self.now + self.rng.uniform(2.0, 5.0), lambda: self.nodes.__setitem__(n, True))

    # -------------------------------------------------------------------- clients

    def _client(self, cid: int) -> None:
        r = self.rng.random()
        key = self.rng.choice(self.keys)
        if r < 0.35:
            self._put(cid, key, upsert=self.rng.random() < 0.15)
        elif r < 0.7:
            self._get(cid, key)
        elif r < 0.8:
            self._exists(cid, key)
        elif r < 0.85:
            prefix = "k" if self.rng.random() < 0.3 else key
            self._remove_prefix(cid, prefix, force=self.rng.random() < 0.3)
        else:
            self._remove(cid, key, force=self.rng.random() < 0.3)

    def _next(self, cid: int) -> None:
        self.at(self.now + self.rng.uniform(0.01, 0.2), lambda: self._client(cid))

    def _put(self, cid: int, key: str, upsert: bool) -> None:
        self.seq += 1
        token = f"c{cid}.{self.seq}"
        h = self.history.invoke(cid, StoreOp("hide", key) if upsert else StoreOp("put", key, token))
        size = self.rng.choice((64, 200, 300, 600, 900))
        pin = self.rng.random()
        rcfg = ReplicateConfig(
            replica_num=self.rng.choice((1, 1, 2)),
            strategy=self.rng.choice(("local", "random", "most_free")),
            writer_host="hn0",
            soft_pin=pin < 0.1,
            hard_pin=0.1 <= pin < 0.13,
        )
        started = self.now
        if not self.lead:
            self.history.fail(h)
            return self._next(cid)
        if upsert:
            sm = self.sms[self.lead]
            up = Upsert([key], [size], rcfg, self.wall(), 2.0)
            plan = self.ldr.plan_upsert([sm.state_of(key) != 0], up, self.now)
            if plan.command is None:
                self.history.ok(h, "leased")
                return self._next(cid)
            self._count_exempt([key])
            cmd: Any = plan.command
            blocked = self.ldr
            blocked.block([key])  # no new lease while a rewrite of the key is in flight
        else:
            cmd = PutStart([key], [size], rcfg, self.wall(), 2.0)
            blocked = None
        self.term_keys.add(key)

        def started_cb(r: Any) -> None:
            if blocked is not None:
                blocked.unblock([key])
            if r is None:
                self.history.info(h)
                return self._next(cid)
            code = r.codes[0]
            if code == Code.OBJECT_ALREADY_EXISTS:
                self.history.ok(h, "exists")
            elif code == Code.REPLICA_IS_NOT_READY:
                self.history.ok(h, "busy")
            elif code != 0:
                self.history.fail(h)
                if code == Code.NO_AVAILABLE_HANDLE:
                    self._maybe_evict(size * 2)
            else:
                version = r.versions[0]
                slices = [
                    (d.segment, d.offset, j)
                    for copy in r.replicas[0]
                    for j, d in enumerate(copy.slices)
                ]
                incs = {s: self.seg_incarn.get(s, -1) for s, _, _ in slices}
                if upsert:
                    # Upsert first hides the old value (the key is PROCESSING until PutEnd),
                    # then publishes the new one: two operations in the history.
                    self.history.ok(h, "ok")
                    h2 = self.history.invoke(cid, StoreOp("put", key, token))
                else:
                    h2 = h
                # most writes are quick; some are slow (a big object, a busy link) and end
                # close to the writer's own deadline (0.8 of the put timeout)
                slow = self.rng.random() < 0.2
                took = self.rng.uniform(0.3, 0.75) if slow else self.rng.uniform(0.01, 0.3)
                self.at(
                    self.now + took * (self.cfg.put_timeout if slow else 1.0),
                    lambda: self._write_done(cid, h2, key, version, slices, started, incs, token),
                )
                return
            self._next(cid)

        if not self.propose(cmd, started_cb):
            if blocked is not None:
                blocked.unblock([key])
            self.history.fail(h)
            self._next(cid)

    def _write_done(
        self,
        cid: int,
        h: int,
        key: str,
        version: int,
        slices: list,
        started: float,
        incs: dict[str, int],
        token: str,
    ) -> None:
        if self.now > started + self.cfg.put_timeout * 0.8 or not all(
            self._serving(s[4:]) and self.seg_incarn[s] == inc for s, inc in incs.items()
        ):
            # Too late (it may be reclaimed) or a target node died: never publish. Revoke.
            self.propose(PutRevoke([key], [version]), lambda r: None)
            self.history.fail(h)
            return self._next(cid)
        self._check_owned(key, version, [(s, o) for s, o, _ in slices], "write")
        for s, o, j in slices:
            self.mem[(s, o)] = _tag(key, version, j)
        self.tokens[(key, version)] = token

        def ended(r: Any) -> None:
            if r is None:
                self.history.info(h)
            elif r.codes[0] == 0:
                self.history.ok(h, "ok")
                self.ldr.touch([key])
            else:
                self.history.fail(h)
            self._next(cid)

        if not self.propose(PutEnd([key], [version]), ended):
            self.history.info(h)  # never proposed: not visible, but its PROCESSING may be reclaimed
            self._next(cid)

    def _read_index(self, cb: Callable[[int], None]) -> bool:
        i = self.lead
        if not i:
            return False
        self.seq += 1
        ctx = b"r%d" % self.seq
        term = self.lead_term

        def served(index: int) -> None:
            if self.lead != i or self.lead_term != term:
                return  # leadership changed: the read is dropped (the client times out)
            if self.sms[i].applied >= index:
                cb(index)
            else:
                self.at(self.now + self.cfg.step, lambda: served(index))

        self.read_ctx[ctx] = served
        try:
            self.net.nodes[i].core.read_index(ctx)
        except NotLeader:
            self.read_ctx.pop(ctx, None)
            return False
        return True

    def _get(self, cid: int, key: str) -> None:
        h = self.history.invoke(cid, StoreOp("get", key))
        state = {"done": False}

        def timeout() -> None:
            if not state["done"]:
                state["done"] = True
                self.history.fail(h)
                self._next(cid)

        def serve(_index: int) -> None:
            if state["done"]:
                return
            state["done"] = True
            sm = self.sms[self.lead]
            if self.ldr.blocked(key):
                self.history.fail(h)
                return self._next(cid)
            lk = sm.lookup([key])[0]
            if lk.code:
                self.history.ok(h, None)
                return self._next(cid)
            until = self.ldr.lease([key], self.now)[0]
            self.ldr.touch([key])
            copy = lk.replicas[self.rng.randrange(len(lk.replicas))]
            slices = [(d.segment, d.offset, j) for j, d in enumerate(copy.slices)]
            rd = _Read(key, lk.version, slices, until, h)
            rd.incs = {d.segment: self.seg_incarn.get(d.segment, -1) for d in copy.slices}
            self.reads.append(rd)
            token = self.tokens.get((key, lk.version))
            self.at(
                self.now + self.rng.uniform(0.0, self.cfg.lease_ttl * 1.3),
                lambda: self._read_done(cid, rd, token),
            )

        if not self._read_index(serve):
            self.history.fail(h)
            return self._next(cid)
        self.at(self.now + 1.0, timeout)

    def _read_done(self, cid: int, rd: _Read, token: Any) -> None:
        self.reads.remove(rd)
        if self.now > rd.until:
            self.res.lease_expired_reads += 1
            self.history.fail(rd.op)  # LeaseExpired: the bytes are discarded
            return self._next(cid)
        for seg, inc in rd.incs.items():
            if not self._serving(seg[4:]) or self.seg_incarn.get(seg) != inc:
                # ReplicaGone: the process that published this segment died (a restarted
                # node publishes its new segment only after the old one expired and the
                # quarantine passed, long after any lease on the old one).
                self.history.fail(rd.op)
                return self._next(cid)
        for seg, off, j in rd.slices:
            got = self.mem.get((seg, off))
            if got != _tag(rd.key, rd.version, j):
                raise SimViolation(
                    f"read of {rd.key!r} v{rd.version} under a lease (until {rd.until:.3f}, "
                    f"now {self.now:.3f}) got foreign bytes at {seg}@{off}"
                )
        self.res.reads_checked += 1
        self.history.ok(rd.op, token)
        self._next(cid)

    def _exists(self, cid: int, key: str) -> None:
        h = self.history.invoke(cid, StoreOp("exists", key))
        state = {"done": False}

        def serve(_index: int) -> None:
            if state["done"]:
                return
            state["done"] = True
            self.history.ok(h, self.sms[self.lead].exists([key])[0])
            self._next(cid)

        def timeout() -> None:
            if not state["done"]:
                state["done"] = True
                self.history.fail(h)
                self._next(cid)

        if not self._read_index(serve):
            self.history.fail(h)
            return self._next(cid)
        self.at(self.now + 1.0, timeout)

    def _remove(self, cid: int, key: str, force: bool) -> None:
        h = self.history.invoke(cid, StoreOp("remove", key))
        if not self.lead:
            self.history.fail(h)
            return self._next(cid)
        ld = self.ldr
        plan = ld.plan_remove([key], self.now, force=force)
        if plan.command is None:
            self.history.ok(h, "leased")
            return self._next(cid)
        self._count_exempt([key], not plan.release_at)
        ld.block([key])
        release_at = plan.release_at

        def done(r: Any) -> None:
            ld.unblock([key])
            if r is None:
                self.history.info(h)
            else:
                c = r.codes[0]
                self.history.ok(h, {0: "ok", int(Code.OBJECT_NOT_FOUND): "notfound"}.get(c, "busy"))
                if c == 0:
                    ld.forget([key])
            self._next(cid)

        cmd = plan.command
        if cmd.hold:
            self.holds_pending = release_at
        idx = self.propose(cmd, done)
        if not idx:
            ld.unblock([key])
            self.history.fail(h)
            return self._next(cid)
        if cmd.hold:
            ld.note_hold(idx, release_at)

    def _remove_prefix(self, cid: int, prefix: str, force: bool) -> None:
        """One round of a remove by prefix, as the service does it: scan the leader's table
        (leased keys skipped unless ``force``), plan with the lease rules, block, propose.
        Every key the entry names joins the history as a ``prune``."""
        if not self.lead:
            return self._next(cid)
        sm = self.sms[self.lead]
        ld = self.ldr
        leased = ld.prefix_leased(self.now, force)
        found, skipped, more = sm.prefix_candidates(prefix, sm.keys(), 4, leased)
        cmd, release_at = ld.plan_remove_prefix(prefix, found, skipped, more, self.now, force)
        t0 = self.now
        hs = [self.history.invoke(cid, StoreOp("prune", k), t=t0) for k in cmd.keys]
        ld.block(cmd.keys)

        def done(r: Any) -> None:
            ld.unblock(cmd.keys)
            for h in hs:
                if r is None:
                    self.history.info(h)
                else:
                    self.history.ok(h, None)
            if r is not None:
                self.res.prefix_removes += 1
                ld.forget(cmd.keys)
            self._next(cid)

        idx = self.propose(cmd, done)
        if not idx:
            ld.unblock(cmd.keys)
            for h in hs:
                self.history.fail(h)
            return self._next(cid)
        if cmd.hold:
            ld.note_hold(idx, release_at)

    # -------------------------------------------------------------------- checks

    def _check_owned(self, key: str, version: int, where: list[tuple[str, int]], what: str) -> None:
        """Every ``(segment, offset)`` is allocated to ``key`` at ``version`` (or held) on
        every replica that has applied at least the version's entry."""
        for i in self.ids:
            sm = self.sms[i]
            if sm.applied < version:
                continue
            names = {s.name: sid for sid, s in sm.segs.items()}
            ext = None
            for seg, off in where:
                sid = names.get(seg)
                if sid is None:
                    continue  # segment dropped: its node is gone, reads fail there
                if ext is None:
                    ext = extents(sm)
                owners = [o for a, b, o in ext.get(sid, []) if a <= off < b]
                ok = bool(owners) and all(
                    o.startswith("held:") or (o == key and sm.version_of(key) == version)
                    for o in owners
                )
                if not ok:
                    raise SimViolation(
                        f"{what}: {seg}@{off} of {key!r} v{version} is now {owners or 'free'}"
                        f" on replica {i} (index {sm.applied})"
                    )

    def _check(self) -> None:
        for i in self.ids:
            errs = check_state(self.sms[i])
            if errs:
                raise SimViolation(
                    f"replica {i} at index {self.sms[i].applied}: " + "; ".join(errs[:3])
                )
        for rd in self.reads:
            if self.now <= rd.until:
                self._check_owned(rd.key, rd.version, [(s, o) for s, o, _ in rd.slices], "lease")
        if self.steps % 25 == 0:
            by_index: dict[int, tuple[int, int]] = {}
            for i in self.ids:
                sm = self.sms[i]
                d = sm.digest()
                prev = by_index.setdefault(sm.applied, (i, d))
                if prev[1] != d:
                    raise SimViolation(f"replicas {prev[0]} and {i} differ at index {sm.applied}")

    # -------------------------------------------------------------------- main loop

    def run(self) -> SimResult:
        cfg = self.cfg
        self.net.elect(1)
        for c in range(cfg.n_clients):
            self.at(0.5 + 0.05 * c, lambda c=c: self._client(c))
        next_fault = 3.0
        next_pause = 2.5 if cfg.pause else float("inf")
        healed_at = None
        with _planted(cfg.plant, self):
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

    def _final_audit(self) -> None:
        """Heal, let the leader settle, then read every key through the leader: each
        visible object's copies on serving nodes hold exactly its bytes, and the answers
        join the history (so an acknowledged put that vanished is not linearizable)."""
        self.net.recover()
        for _ in range(300):
            self.now += self.cfg.step
            self.steps += 1
            if self.steps % self.cfg.tick_every == 0:
                for node in self.net.nodes.values():
                    node.core.tick()
            self.net.deliver_once()
            self._apply_all()
            lead = self.leader()
            if lead != self.lead or (lead and self.net.nodes[lead].core.term != self.lead_term):
                self._leader_change(lead)
            for idx, p in list(self.proposals.items()):
                if self.now > p.deadline and not p.done:
                    p.done = True
                    del self.proposals[idx]
                    p.cb(None)
            if self.lead and not self.proposals:
                sm = self.sms[self.lead]
                hn = self.net.nodes[self.lead]
                if sm.applied >= hn.core.log.committed:
                    break
        if not self.lead:
            return
        self._check()
        sm = self.sms[self.lead]
        for key in self.keys:
            lk = sm.lookup([key])[0]
            h = self.history.invoke("audit", StoreOp("get", key))
            if lk.code:
                self.history.ok(h, None)
                continue
            for copy in lk.replicas:
                if not all(self._serving(d.segment[4:]) for d in copy.slices):
                    continue
                for j, d in enumerate(copy.slices):
                    if self.mem.get((d.segment, d.offset)) != _tag(key, lk.version, j):
                        raise SimViolation(
                            f"audit: {key!r} v{lk.version} has foreign bytes at "
                            f"{d.segment}@{d.offset}"
                        )
                self.res.reads_checked += 1
            self.history.ok(h, self.tokens.get((key, lk.version)))

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


@contextmanager
def _planted(plant: str | None, sim: StoreSim):
    """Negative controls: plant a bug in the real state machine or the real leader
    (store/leader.py) for the run."""
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, fn: Any) -> None:
        patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, fn)

    if plant == "lost_put":
        orig_end = getattr(state_mod.StoreStateMachine, "_put_end")  # noqa: B009 (the plant replaces it)

        def lossy_put_end(self: StoreStateMachine, index: int, c: PutEnd):
            # acknowledges every key but never publishes some of them
            kept = [(k, v) for k, v in zip(c.keys, c.versions) if zlib.crc32(k.encode()) % 3]
            res = orig_end(self, index, PutEnd([k for k, _ in kept], [v for _, v in kept]))
            return type(res)([0] * len(c.keys))

        patch(state_mod.StoreStateMachine, "_put_end", lossy_put_end)
    elif plant == "raw_gap":
        # the old rule: liveness judged on the raw clock gap, a stopped leader's own pause
        # counted as the nodes' silence
        def raw_advance(self: LivenessJudge, now: float) -> bool:
            if now > self._seen:
                self.heard += now - self._seen
                self._seen = now
            return False

        patch(LivenessJudge, "_advance", raw_advance)
    elif plant == "double_free":
        patch(state_mod.StoreStateMachine, "_release", _leaky_release)
        patch(Leader, "released", lambda self, cmd, result: None)  # and released again
    elif plant == "lease_ignored":
        orig_evict = Leader.eviction

        def evict_unleased(self: Leader, now: float, wall: float, need=0, objects=0):
            real, self.leases = self.leases, LeaseTable()  # the choice sees no lease
            try:
                cmd = orig_evict(self, now, wall, need, objects)
            finally:
                self.leases = real
            if cmd is not None:
                real.block(cmd.keys)  # evicted() unblocks them there
            return cmd

        patch(Leader, "eviction", evict_unleased)
    elif plant == "prefix_lease_ignored":
        patch(Leader, "prefix_leased", lambda self, now, force: None)
        patch(
            Leader,
            "plan_remove_prefix",
            lambda self, prefix, found, skipped, more, now, force: plan_remove_prefix(
                prefix, found, skipped, more, LeaseTable(), now, force
            ),
        )
    elif plant == "no_grace":  # a new leader skips the grace period (as if alone)
        orig_elected = Leader.elected
        patch(
            Leader,
            "elected",
            lambda self, now, first, applied, alone=False: orig_elected(
                self, now, first, applied, True
            ),
        )
    elif plant == "fresh_by_key":  # "a key put under this leader" judged by name
        orig_fresh = Leader.fresh
        patch(Leader, "fresh", lambda self, key: key in sim.term_keys or orig_fresh(self, key))
    elif plant == "wall_reclaim":  # the old rule: a wall-clock cutoff in apply
        patch(
            Leader,
            "reclaim",
            lambda self, now, wall: [Reclaim(wall, self.cfg.put_timeout_s)],
        )
    elif plant == "stale_alive":
        # every node the table holds judged alive at each tick, whatever its last heartbeat
        orig_expiry = Leader.expiry

        def expiry_fresh(self: Leader, now: float, wall: float):
            self.liveness.reset(self.sm.nodes(), now)
            return orig_expiry(self, now, wall)

        patch(Leader, "expiry", expiry_fresh)
    elif plant is not None:
        raise ValueError(f"unknown plant {plant!r}")
    try:
        yield
    finally:
        for owner, name, orig in reversed(patches):
            setattr(owner, name, orig)


def _leaky_release(self: StoreStateMachine, index: int, c: Release):
    """Release that frees the held bytes but keeps the hold (the double_free plant)."""
    from .commands import Codes

    codes = []
    for tag in c.tags:
        ext = self.held.get(tag)
        if ext is None:
            codes.append(int(Code.OBJECT_NOT_FOUND))
            continue
        for sid, off, ln in ext:
            seg = self.segs.get(sid)
            if seg is not None:
                try:
                    seg.alloc.free(off, ln)
                except Exception:
                    pass
        codes.append(0)
    return Codes(codes)


def run_seed(seed: int, **kw: Any) -> SimResult:
    return StoreSim(SimConfig(seed=seed, **kw)).run()


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--plant", default=None)
    p.add_argument("--clock-skew", type=float, default=0.0)
    p.add_argument("--pause", type=float, default=0.0, help="host-wide pauses of this long")
    a = p.parse_args(argv)
    bad = 0
    for s in range(a.first, a.first + a.seeds):
        r = run_seed(s, duration=a.duration, plant=a.plant, clock_skew=a.clock_skew, pause=a.pause)
        print(
            f"seed {s}: {'ok' if r.ok else 'VIOLATION'} entries={r.entries} "
            f"reads={r.reads_checked} evictions={r.evictions} expiries={r.expiries} "
            f"drains={r.drains} holds={r.holds_released} "
            f"leaders={r.leader_changes} prefix={r.prefix_removes} lin={r.lin_outcome}"
        )
        if not r.ok:
            bad += 1
            print("  " + r.violation.replace("\n", "\n  "))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
