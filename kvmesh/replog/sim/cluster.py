"""Seeded discrete-event simulation of a replicated KV store on the real Raft core.

One ``random.Random(seed)``, a virtual clock and a priority queue of events drive N replicas
(each: :class:`~kvmesh.replog.core.raft.RaftCore`, a :class:`~.disk.SimDisk`, the production
session + KV state machine), a faulty :class:`~.network.SimNetwork`, clients that time out and
retry with the same ``(client_id, seq)``, and a :class:`~.nemesis.Nemesis`. Invariants are
checked as the run goes (:mod:`.invariants`); at the end the cluster is healed, liveness is
checked, every key is read through the leader, and the client history goes through the
linearizability checker and the lost-acknowledged-write check.

The seed fully determines a run: ``python -m kvmesh.replog.sim --seed N -v`` replays one.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from ..core.raft import RaftCore
from ..kvsm import KvCas, KvDelete, KvPut, encode_command
from ..readypath import APPLY_SLICE, SYNC, SYNC_BEGIN, YIELD, ReadyPath
from ..session import Command, Register, SessionRejected, encode_envelope
from ..storage.memory import MemoryStorage
from ..types import (
    ConfChangeType,
    EntryKind,
    InstallSnapshot,
    NotLeader,
    PreVote,
    ProposalDropped,
    RaftConfig,
    ReadOnlyOption,
    Ready,
    Role,
    SnapshotMeta,
    Vote,
    VoteResp,
    decode_conf_change,
    decode_message,
    encode_message,
)
from .disk import SimDisk
from .invariants import Invariants, SimViolation
from .kv import ApplyLedger, make_state_machine, state_digest
from .linearizability import History, KvModel, KvOp, check, lost_acknowledged_writes
from .network import NetParams, SimNetwork

__all__ = [
    "SimConfig",
    "SimResult",
    "Simulator",
    "SimNode",
    "SimClient",
    "run_seed",
    "run_seed_args",
]

_NORMAL = int(EntryKind.NORMAL)
WRITE_OPS = ("put", "delete", "cas")


class SimConfig(msgspec.Struct, kw_only=True):
    """Everything a run depends on besides the seed. ``SimConfig.generate(seed)`` draws one
    from the seed; tests build specific ones."""

    seed: int = 0
    n_voters: int = 3
    n_clients: int = 4
    n_keys: int = 10
    duration: float = 20.0  # seconds of workload and faults (virtual)
    tick: float = 0.1
    raft: RaftConfig = RaftConfig(election_tick=10, heartbeat_tick=1)
    durability: str = (
        "disk"  # "disk" | "memory" | "ack_before_fsync" (the last two are negative controls)
    )
    net_delay: float = 0.002
    net_jitter: float = 0.003
    client_delay: float = 0.001
    fsync_min: float = 0.0005
    fsync_max: float = 0.004
    snapshot_every: int = 150  # applied entries between snapshots; 0 = never
    apply_slice: int = APPLY_SLICE  # committed entries applied between two yields
    trailing: int = 40  # entries kept after a snapshot
    keep_unsynced_prefix: bool = True  # a crash may keep a random prefix of unsynced writes
    nemesis: bool = True
    faults: tuple[str, ...] = ()  # () = all; see nemesis.FAULTS
    fault_min: float = 1.0
    fault_max: float = 6.0
    max_concurrent_faults: int = 2
    clock_drift: float = 0.0  # nemesis clock faults change tick rates by up to this fraction
    client_timeout: float = 1.5
    op_deadline: float = 6.0
    think_max: float = 0.05
    read_ratio: float = 0.35
    follower_read_ratio: float = 0.25
    buggify: bool = True
    check_linearizability: bool = True
    # Raft-internal oracles (election safety, leader completeness, ...). Negative controls
    # turn them off to show that the client-side checks alone catch the damage.
    internal_checks: bool = True
    # Deliver the ticks a frozen node missed before it handles anything else (the driver
    # contract for leases); False is a negative control.
    catch_up_ticks: bool = True
    lin_timeout: float = 20.0
    # Each replica's first tick comes at a random point of the tick interval instead of all
    # ticking together (live replicas' tickers are not aligned; sim/failover.py).
    tick_phase: bool = False
    profile: str = "ci"  # what generate() drew this configuration for (replay hints)

    @property
    def election_max_s(self) -> float:
        return self.raft.election_range[1] * self.tick

    @classmethod
    def generate(cls, seed: int, profile: str = "ci") -> SimConfig:
        """A random configuration drawn from ``seed``; ``profile`` "ci" keeps runs short,
        "soak" makes them longer and larger."""
        r = random.Random(seed ^ 0x5EED)
        soak = profile == "soak"
        lease = r.random() < 0.3
        buggify = r.random() < 0.8
        raft = RaftConfig(
            election_tick=r.choice((5, 10)),
            heartbeat_tick=r.choice((1, 2)),
            pre_vote=r.random() < 0.9,
            check_quorum=True,
            read_only_option=ReadOnlyOption.LEASE_BASED if lease else ReadOnlyOption.SAFE,
            lease_drift_bound=0.1,
            max_size_per_msg=r.choice((256, 4096, 1 << 20)) if buggify else 1 << 20,
            max_inflight_msgs=1 if buggify and r.random() < 0.15 else r.choice((4, 64, 256)),
            max_uncommitted_bytes=r.choice((0, 4096, 1 << 20)),
        )
        return cls(
            seed=seed,
            n_voters=r.choice((3, 3, 5)) if soak else r.choice((3, 3, 3, 5)),
            n_clients=r.randint(3, 10) if soak else r.randint(3, 4),
            n_keys=r.choice((3, 8, 20)),
            duration=r.uniform(25.0, 60.0) if soak else r.uniform(10.0, 16.0),
            think_max=0.05 if soak else 0.1,
            raft=raft,
            net_delay=r.uniform(0.0005, 0.005),
            net_jitter=r.uniform(0.0005, 0.01),
            snapshot_every=r.choice((0, 30, 100, 300)),
            trailing=r.choice((5, 40)),
            clock_drift=0.03 if lease else r.choice((0.0, 0.5)),
            client_timeout=r.uniform(1.0, 3.0),
            op_deadline=r.uniform(4.0, 10.0),
            read_ratio=r.uniform(0.2, 0.5),
            buggify=buggify,
            profile=profile,
            # Drawn last so that the draws above stay what they were for every seed.
            apply_slice=r.choice((2, 7, APPLY_SLICE)) if buggify else APPLY_SLICE,
        )


class SimResult(msgspec.Struct, kw_only=True):
    """Outcome of one run. ``violation`` names the failed invariant (None if all held)."""

    seed: int
    ok: bool
    profile: str = "ci"
    violation: str | None = None
    detail: str = ""
    trace: list[str] = []
    ops_ok: int = 0
    ops_unknown: int = 0
    ops_failed: int = 0
    writes_acked: int = 0
    elections: int = 0
    crashes: int = 0
    messages: int = 0
    max_term: int = 0
    commit_index: int = 0
    snapshots: int = 0
    snapshots_replayed: int = 0
    stale_snapshots: int = 0  # delayed duplicate InstallSnapshots delivered (stale_snapshot)
    figure8: int = 0  # times a leader's replicas held a majority of an older-term entry only
    contested_votes: int = 0  # campaigns that reached a node following a live leader
    faults: list[str] = []
    virtual_s: float = 0.0
    wall_s: float = 0.0
    lin_outcome: str = ""

    def replay_hint(self) -> str:
        return f"python -m kvmesh.replog.sim --seed {self.seed} --profile {self.profile} -v"


# ==========================================================================================
# Nodes
# ==========================================================================================


class SimNode:
    """One replica: core + simulated disk + state machine, driven by simulator events. Its
    Ready processing is the driver's own (:class:`~kvmesh.replog.readypath.ReadyPath`): this
    class is only the host (network, state machine) and performs the path's effects in
    virtual time (an fsync completes after a latency; a yield lets queued events run)."""

    def __init__(self, sim: Simulator, node_id: int, storage: MemoryStorage) -> None:
        self.sim = sim
        self.id = node_id
        self.disk = SimDisk(storage, volatile_only=sim.cfg.durability == "memory")
        self.alive = False
        self.paused = False
        self.removed = False
        self.incarnation = 0
        self.drift = 1.0
        self.fsync_factor = 1.0  # a slow disk (nemesis)
        self.inbox: list = []
        self.deferred = False
        self.core: RaftCore
        sim.durables[node_id] = self.disk.durable
        self.start()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        sim = self.sim
        self.incarnation += 1
        st = self.disk.live
        sm = make_state_machine(self.id, sim.ledger)
        snap = st.snapshot()
        if snap.meta.index:
            sm.restore(snap.data)
            sim.inv.snapshot_restored(self.id, snap.meta.index, state_digest(sm))
        self.sm = sm
        self.applied = snap.meta.index
        self.last_snap = snap.meta.index
        self.core = RaftCore(
            self.id, st, sim.raft_cfg, random.Random(sim.rng.random()), applied=snap.meta.index
        )
        self.path = ReadyPath(self.core, self.disk, self, sim.cfg.apply_slice)
        self._gen = None  # the Ready being processed (a ReadyPath.run generator)
        self.sync_state: str | None = None  # SYNC_BEGIN's fsync: running / waiting / done
        self._ss = None
        self.busy = False
        self.paused = False
        self.inbox = []
        self.deferred = False  # the path's wait ended while paused: resume on resume()
        self.missed_ticks = 0
        self.pending_writes: dict[int, tuple[int, SimClient, int]] = {}
        self.pending_reads: dict[bytes, tuple[SimClient, int, str]] = {}
        self.read_waits: list[tuple[int, SimClient, int, str]] = []
        self.read_ctr = 0
        self.prev_commit = self.core.log.committed
        self.step_commit = self.prev_commit
        self.alive = True
        if sim.cfg.tick_phase:
            sim.schedule(sim.cfg.tick * sim.rng.random(), self._on_tick, self.incarnation)
        else:
            self._schedule_tick()
        self.pump()

    def crash(self) -> None:
        if not self.alive:
            return
        sim = self.sim
        self.alive = False
        self.incarnation += 1
        keep = sim.cfg.keep_unsynced_prefix
        self.disk.crash(sim.rng, keep_prefix=keep)
        self.pending_writes.clear()
        self.pending_reads.clear()
        self.read_waits.clear()
        sim.crashes += 1
        sim.log_event("crash", self.id, f"term={self.core.term}")

    def restart(self) -> None:
        if self.alive:
            return
        self.start()
        self.sim.log_event(
            "restart", self.id, f"term={self.core.term} last={self.core.log.last_index()}"
        )

    def pause(self) -> None:
        if self.alive:
            self.paused = True

    def resume(self) -> None:
        if not self.alive or not self.paused:
            return
        self.paused = False
        # Driver contract: time that passed while frozen is delivered as ticks before any
        # message or request is handled (a monotonic clock does not stop), so that a
        # leader's lease cannot outlive the freeze.
        missed, self.missed_ticks = self.missed_ticks, 0
        if self.sim.cfg.catch_up_ticks:
            for _ in range(missed):
                self.core.tick()
        if self.deferred:
            self.deferred = False
            self._step()
        inbox, self.inbox = self.inbox, []
        for item in inbox:
            if not self.alive or self.paused:
                break
            if isinstance(item, tuple):
                self.on_request(*item)
            else:
                self.core.step(item)
                self._stepped()
        self.pump()

    # -- events ------------------------------------------------------------------------------

    def _schedule_tick(self) -> None:
        self.sim.schedule(self.sim.cfg.tick * self.drift, self._on_tick, self.incarnation)

    def _on_tick(self, inc: int) -> None:
        if inc != self.incarnation or not self.alive:
            return
        if self.paused:
            self.missed_ticks += 1
        else:
            self.core.tick()
            self.pump()
        self._schedule_tick()

    def deliver(self, m) -> None:
        if not self.alive:
            return
        if self.paused:
            self.inbox.append(m)
            return
        t = type(m)
        if (
            (t is Vote or t is PreVote)
            and not m.transfer
            and m.term > self.core.term
            and self.core.lead
        ):
            self.sim.contested_votes += 1  # a campaign reaching a node that follows a leader
        self.core.step(m)
        self._stepped()
        self.pump()

    def _stepped(self) -> None:
        core = self.core
        if core.role == Role.LEADER:
            # A leader moves its commit index while stepping answers: check each move then,
            # not only at the next Ready (a later move onto its own term would hide it).
            self.step_commit = self.sim.inv.leader_stepped(self.id, core, self.step_commit)
        else:
            self.step_commit = core.log.committed

    def on_request(self, client: SimClient, req_id: int, op: tuple) -> None:
        if not self.alive:
            return
        if self.paused:
            self.inbox.append((client, req_id, op))
            return
        core = self.core
        kind = op[0]
        if kind == "get":
            self.read_ctr += 1
            ctx = b"%d:%d:%d" % (self.id, self.incarnation, self.read_ctr)
            try:
                core.read_index(ctx)
            except NotLeader as e:
                self.reply(client, req_id, ("redirect", e.leader_hint))
                return
            self.pending_reads[ctx] = (client, req_id, op[1])
        else:
            data = op[-1]  # encoded envelope
            try:
                idx = core.propose(data)
            except NotLeader as e:
                self.reply(client, req_id, ("redirect", e.leader_hint))
                return
            except ProposalDropped:
                self.reply(client, req_id, ("retry", None))
                return
            old = self.pending_writes.get(idx)
            if old is not None:
                self.reply(old[1], old[2], ("retry", None))
            self.pending_writes[idx] = (core.term, client, req_id)
        self.pump()

    def reply(self, client: SimClient, req_id: int, reply: tuple) -> None:
        sim = self.sim
        sim.schedule(sim.cfg.client_delay * (1 + sim.rng.random()), client.on_reply, req_id, reply)

    # -- the Ready loop: the shared path, its effects in virtual time --------------------------

    def pump(self) -> None:
        sim = self.sim
        core = self.core
        if self.sync_state == "waiting" and self.alive and not self.paused:
            # The driver waits for its Ready's fsync: a leader sends what became sendable
            # at once (node.RaftNode._sync_wait).
            msgs = core.take_send_now()
            if msgs:
                # Its Appends carry the commit index: checked before anyone acts on it.
                sim.inv.leader_commit(self.id, core, sim.durables)
                self._send_all(msgs)
        while self.alive and not self.busy and not self.paused and core.has_ready():
            rd = core.ready()
            if rd.entries_to_append and core.role == Role.LEADER:
                sim.inv.leader_appended(self.id, core.term, rd.entries_to_append)
            # Before anything of this Ready acts on the commit index (messages, applying).
            sim.inv.leader_commit(self.id, core, sim.durables)
            self._gen = self.path.run(rd)
            self.busy = True
            self._step()

    def _step(self, result=None) -> None:
        """Run the path until it waits (fsync, yield) or ends."""
        sim = self.sim
        mode = sim.cfg.durability
        gen = self._gen
        while True:
            try:
                eff = gen.send(result)
            except StopIteration:
                self._gen = None
                self.busy = False
                return
            result = None
            if eff is SYNC_BEGIN:
                if mode == "memory":
                    continue
                mark = self.disk.fsync_mark()
                lat = sim.fsync_latency() * self.fsync_factor
                if mode == "ack_before_fsync":
                    # Negative control: a driver that does not wait for its fsync.
                    sim.schedule(lat, self._fsync_only, self.incarnation, mark)
                    continue
                # The fsync runs while the path goes on (applies); SYNC waits for it.
                self.sync_state = "running"
                sim.schedule(lat, self._fsync_begun_done, self.incarnation, mark)
                continue
            if eff is SYNC:
                if mode == "memory" or mode == "ack_before_fsync":
                    continue
                if self.sync_state == "done":
                    self.sync_state = None
                    continue
                if self.sync_state == "running":
                    self.sync_state = "waiting"
                    return
                mark = self.disk.fsync_mark()
                lat = sim.fsync_latency() * self.fsync_factor
                sim.schedule(lat, self._fsync_done, self.incarnation, mark)
                return
            if eff is YIELD:
                if sim.buggify and sim.cfg.snapshot_every and sim.rng.random() < 0.2:
                    self.take_snapshot()  # BUGGIFY: a snapshot between two apply slices
                sim.schedule(0.0, self._resume, self.incarnation)
                return
            result = eff()  # blocking I/O: instantaneous here

    def _resume(self, inc: int) -> None:
        if inc != self.incarnation or not self.alive:
            return
        if self.paused:
            self.deferred = True
            return
        self._step()
        self.pump()

    def _fsync_only(self, inc: int, mark: int) -> None:
        if inc == self.incarnation:
            self.disk.fsync_complete(mark)

    def _fsync_begun_done(self, inc: int, mark: int) -> None:
        if inc != self.incarnation or not self.alive:
            return
        if self.sync_state == "running":
            # The path has not reached SYNC yet (it is applying): it finds this at SYNC.
            self.disk.fsync_complete(mark)
            self.sync_state = "done"
            return
        self.sync_state = None
        self._fsync_done(inc, mark)

    def _fsync_done(self, inc: int, mark: int) -> None:
        if inc != self.incarnation or not self.alive:
            return
        self.disk.fsync_complete(mark)
        if self.paused:
            # A frozen process does not act on the completion until it resumes.
            self.deferred = True
            return
        self._step()
        self.pump()

    # ReadyHost

    def send(self, msgs: list, after_persist: bool) -> None:
        sim = self.sim
        if not after_persist and sim.buggify and len(msgs) > 1 and sim.rng.random() < 0.05:
            msgs = list(msgs)
            sim.rng.shuffle(msgs)
        self._send_all(msgs)

    def _send_all(self, msgs: list) -> None:
        if not msgs:
            return
        sim = self.sim
        inv = sim.inv
        durable = self.disk.durable
        for m in msgs:
            inv.message_sent(self.id, m, durable)
            sim.send(m)
            if sim.buggify and type(m) is VoteResp and sim.rng.random() < 0.05:
                sim.send(m)  # BUGGIFY: a vote response sent twice

    def install(self, snap) -> None:
        self.sm.restore(snap.data)
        self.applied = snap.meta.index
        self.sim.inv.snapshot_restored(self.id, snap.meta.index, state_digest(self.sm))

    def apply(self, ents: list) -> None:
        sim = self.sim
        inv = sim.inv
        voters = self.core.voters
        durables = sim.durables
        sm = self.sm
        pw = self.pending_writes
        for e in ents:
            inv.entry_applied(self.id, e, voters, durables)
            result = None
            if e.kind == _NORMAL:
                if e.data:
                    result = sm.apply(e.index, e.data)
            else:
                cc = decode_conf_change(e.data)
                if cc.type == ConfChangeType.REMOVE_NODE and cc.node_id in sim.nodes:
                    sim.nodes[cc.node_id].removed = True
            self.applied = e.index
            if pw:
                w = pw.pop(e.index, None)
                if w is not None:
                    term, client, req_id = w
                    if e.term == term:
                        if type(result) is SessionRejected:
                            sim.session_rejections.append(
                                f"node {self.id} index {e.index}: {result!r}"
                            )
                        self.reply(client, req_id, ("ok", result))
                    else:
                        self.reply(client, req_id, ("retry", None))

    def before_advance(self, rd: Ready) -> None:
        for rs in rd.read_states:
            req = self.pending_reads.pop(rs.context, None)
            if req is not None:
                self.read_waits.append((rs.index, *req))

    def after_advance(self, rd: Ready) -> None:
        sim = self.sim
        inv = sim.inv
        core = self.core
        ss = rd.soft_state
        self.prev_commit = inv.commit_progress(self.id, core, self.prev_commit)
        if ss is not None:
            # A soft state reports what the core was when the Ready was made; after a slow
            # fsync the node may have stepped down (into a later term) since.
            if ss.role == Role.LEADER and core.role == Role.LEADER:
                sim.elections += 1
                inv.became_leader(self.id, core)
                sim.check_lease_overlap(self.id)
                sim.check_churn(self.id)
                sim.log_event("leader", self.id, f"term={core.term} last={core.log.last_index()}")
            elif self.pending_reads:
                # Leadership changed: reads forwarded or queued under the old leader are gone.
                for _ctx, (client, req_id, _key) in self.pending_reads.items():
                    self.reply(client, req_id, ("retry", None))
                self.pending_reads.clear()
        if self.read_waits:
            self._serve_reads()
        if sim.cfg.snapshot_every and self.applied - self.last_snap >= sim.cfg.snapshot_every:
            self.take_snapshot()

    def _serve_reads(self) -> None:
        keep = []
        for item in self.read_waits:
            index, client, req_id, key = item
            if self.applied >= index:
                self.reply(client, req_id, ("ok", self.sm.inner.get(key)))
            else:
                keep.append(item)
        self.read_waits = keep

    def take_snapshot(self) -> None:
        """A local snapshot at the path's applied point (also between two apply slices)."""
        if not self.alive or self.paused:
            return
        sim = self.sim
        disk = self.disk
        idx, conf = self.path.snapshot_point()
        if idx <= disk.live.snapshot().meta.index:
            return
        data = self.sm.snapshot()
        meta = SnapshotMeta(idx, disk.live.term(idx), conf)
        if not disk.commit_local_snapshot(meta, disk.stage_local_snapshot(meta, [data])):
            return
        self.last_snap = idx
        sim.snapshots += 1
        sim.inv.snapshot_taken(self.id, idx, state_digest(self.sm), conf)
        compact_to = idx - sim.cfg.trailing
        if compact_to >= disk.live.first_index():
            disk.compact(compact_to)


# ==========================================================================================
# Clients
# ==========================================================================================


class SimClient:
    """Issues one operation at a time, retrying (same seq) until answered or out of time."""

    def __init__(self, sim: Simulator, idx: int) -> None:
        self.sim = sim
        self.idx = idx
        self.rng = random.Random(sim.rng.random())
        self.cid: int | None = None
        self.seq = 0
        self.op: tuple | None = None
        self.handle: int | None = None
        self.hist_input: KvOp | None = None
        self.req_id = 0
        self.target: int | None = None
        self.deadline = 0.0
        self.backoff = 0.02
        self.scripted: deque = deque()
        self.done_callbacks: list[Callable[[Any], None]] = []
        self.idle = True
        self.records_final = False  # the end-of-run reader: its gets are the final state
        self.scripted_only = False  # scenario clients run only what is submitted

    # -- operation choice ----------------------------------------------------------------------

    def start(self) -> None:
        self.sim.schedule(self.rng.random() * 0.1, self.next_op)

    def _choose(self) -> tuple[tuple, KvOp | None] | None:
        sim = self.sim
        if self.cid is None:
            return ("register", encode_envelope(Register())), None
        if self.scripted:
            return self._build(*self.scripted.popleft())
        if sim.stopping or self.scripted_only:
            return None
        r = self.rng
        key = f"k{r.randrange(sim.cfg.n_keys)}"
        x = r.random()
        if x < sim.cfg.read_ratio or sim.quiet:
            return self._build("get", key)
        x = r.random()
        if x < 0.7:
            return self._build("put", key)
        if x < 0.85:
            return self._build("delete", key)
        return self._build("cas", key, sim.last_value.get(key))

    def _build(
        self, kind: str, key: str, expected: Any = None, follower: bool | None = None
    ) -> tuple[tuple, KvOp]:
        if kind == "get":
            if follower is None:
                follower = self.rng.random() < self.sim.cfg.follower_read_ratio
            return ("get", key, follower), KvOp.get(key)
        self.seq += 1
        value = b"c%d-s%d" % (self.cid, self.seq)
        if kind == "put":
            body, hop = KvPut(key, value), KvOp.put(key, value)
        elif kind == "delete":
            body, hop = KvDelete(key), KvOp.delete(key)
        else:
            body, hop = KvCas(key, expected, value), KvOp.cas(key, expected, value)
        env = encode_envelope(Command(self.cid, self.seq, encode_command(body), ack=self.seq))
        return (kind, key, env), hop

    def next_op(self) -> None:
        if self.op is not None:
            return
        choice = self._choose()
        if choice is None:
            self.idle = True
            return
        self.idle = False
        self.op, self.hist_input = choice
        sim = self.sim
        self.handle = (
            sim.history.invoke(self.idx, self.hist_input) if self.hist_input is not None else None
        )
        self.deadline = sim.now + sim.cfg.op_deadline
        self.target = None if self.op[0] == "get" and self.op[2] else self.target
        self.backoff = 0.02
        self.send()

    def submit(
        self,
        kind: str,
        key: str,
        expected: Any = None,
        follower: bool = False,
        target: int | None = None,
    ) -> None:
        """Queue one operation (scripted scenarios); it starts when the previous one ends."""
        self.scripted.append(
            (kind, key, expected, follower) if kind == "get" else (kind, key, expected)
        )
        if target is not None:
            self.target = target
        if self.op is None:
            self.next_op()

    # -- attempts ------------------------------------------------------------------------------

    def send(self) -> None:
        sim = self.sim
        self.req_id += 1
        node = self.target
        if node is None or node not in sim.nodes or sim.nodes[node].removed:
            node = self.rng.choice(sim.client_targets())
        sim.client_send(node, self, self.req_id, self.op)
        sim.schedule(sim.cfg.client_timeout, self.on_timeout, self.req_id)

    def on_reply(self, req_id: int, reply: tuple) -> None:
        if req_id != self.req_id or self.op is None:
            return
        kind, val = reply
        if kind == "ok":
            self._complete(val)
        elif kind == "redirect":
            self.target = val if val else None
            self._retry(0.005 if val else self._next_backoff())
        else:
            self.target = None
            self._retry(self._next_backoff())

    def on_timeout(self, req_id: int) -> None:
        if req_id != self.req_id or self.op is None:
            return
        self.target = None
        self._retry(0.0)

    def _next_backoff(self) -> float:
        b = self.backoff
        self.backoff = min(self.backoff * 2, 0.5)
        return b * (0.5 + self.rng.random())

    def _retry(self, delay: float) -> None:
        sim = self.sim
        if sim.now + delay >= self.deadline:
            self._give_up()
            return
        self.req_id += 1  # invalidates the outstanding attempt's reply/timeout
        sim.schedule(delay, self._resend, self.req_id)

    def _resend(self, rid: int) -> None:
        if rid == self.req_id and self.op is not None:
            self.send()

    def _give_up(self) -> None:
        sim = self.sim
        op = self.op
        if self.handle is not None:
            if op[0] == "get":
                sim.history.fail(self.handle)
                sim.ops_failed += 1
            else:
                sim.history.info(self.handle)
                sim.ops_unknown += 1
        self._done(None)

    def _complete(self, val: Any) -> None:
        sim = self.sim
        op = self.op
        if op[0] == "register":
            self.cid = val
        elif self.handle is not None:
            if isinstance(val, SessionRejected):
                # Outcome unknown (an earlier attempt may have been applied before the session
                # vanished); the client opens a new session for what follows.
                sim.history.info(self.handle)
                sim.ops_unknown += 1
                self.cid = None
            else:
                sim.history.ok(self.handle, val)
                sim.ops_ok += 1
                if op[0] in WRITE_OPS:
                    sim.writes_acked += 1
                    if op[0] == "put" or (op[0] == "cas" and val):
                        sim.last_value[op[1]] = self.hist_input.value
                if op[0] == "get" and self.records_final:
                    sim.final_reads[op[1]] = val
        self._done(val)

    def _done(self, val: Any) -> None:
        self.op = None
        self.handle = None
        self.req_id += 1
        for cb in self.done_callbacks:
            cb(val)
        self.sim.schedule(self.rng.random() * self.sim.cfg.think_max, self.next_op)


# ==========================================================================================
# Simulator
# ==========================================================================================


class Simulator:
    """See the module docstring. ``run()`` performs a whole randomised run; tests may
    instead script one with :meth:`at`, :meth:`run_until` and the fault helpers."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.buggify = cfg.buggify
        self.raft_cfg = cfg.raft
        self.now = 0.0
        self._q: list = []
        self._seq = 0
        self.net = SimNetwork(
            random.Random(self.rng.random()), NetParams(delay=cfg.net_delay, jitter=cfg.net_jitter)
        )
        self.inv = Invariants(durable_checks=cfg.durability == "disk", enabled=cfg.internal_checks)
        self.inv.verified_commit = cfg.n_voters  # the bootstrap prefix is durable everywhere
        self.ledger = ApplyLedger()
        self.history = History(clock=lambda: self.now)
        self.trace: deque = deque(maxlen=400)
        self.nodes: dict[int, SimNode] = {}
        self.durables: dict[int, MemoryStorage] = {}
        self.clients: list[SimClient] = []
        self.stopping = False
        self.last_value: dict[str, bytes] = {}
        self.final_reads: dict[str, Any] = {}
        self.session_rejections: list[str] = []
        self.ops_ok = self.ops_unknown = self.ops_failed = self.writes_acked = 0
        self.elections = self.crashes = self.snapshots = 0
        self.faults_applied: list[str] = []
        self.next_node_id = cfg.n_voters + 1
        voters = list(range(1, cfg.n_voters + 1))
        for i in voters:
            self.add_node(i, MemoryStorage.bootstrap(voters))
        self.nemesis = None
        self.stall_until = 0.0  # end of the latest BUGGIFY disk stall (check_churn)
        self._ref_event_scheduled = False
        # node -> delay: InstallSnapshot messages to it arrive once more that much later
        # (the nemesis' stale-snapshot schedule).
        self.replay_snapshots: dict[int, float] = {}
        self.quiet = False  # clients only read (the nemesis' vote-suppression schedule)
        # Coverage of the situations the targeted schedules aim at (reported per run).
        self.stale_snapshots = 0
        self.contested_votes = 0

    # -- event queue ---------------------------------------------------------------------------

    def schedule(self, delay: float, fn: Callable, *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._q, (self.now + delay, self._seq, fn, args))

    def at(self, t: float, fn: Callable, *args: Any) -> None:
        """Schedule ``fn(*args)`` at absolute virtual time ``t``."""
        self._seq += 1
        heapq.heappush(self._q, (t, self._seq, fn, args))

    def run_until(self, t: float) -> None:
        q = self._q
        pop = heapq.heappop
        while q and q[0][0] <= t:
            when, _, fn, args = pop(q)
            self.now = when
            fn(*args)
        self.now = max(self.now, t)

    def fsync_latency(self) -> float:
        cfg = self.cfg
        lat = cfg.fsync_min + self.rng.random() * (cfg.fsync_max - cfg.fsync_min)
        if self.buggify and self.rng.random() < 0.01:
            lat *= 50  # BUGGIFY: one very slow fsync
            # A disk stall longer than an election timeout is a fault like the nemesis's
            # slow disk: a stalled leader sends no heartbeats, stalled followers no acks,
            # so no stable window (check_churn) begins before it ends.
            self.stall_until = max(self.stall_until, self.now + lat)
        return lat

    def log_event(self, kind: str, node: int, detail: str = "") -> None:
        self.trace.append((self.now, kind, node, detail))

    # -- nodes ---------------------------------------------------------------------------------

    def add_node(self, node_id: int, storage: MemoryStorage) -> SimNode:
        n = SimNode(self, node_id, storage)
        self.nodes[node_id] = n
        self.durables[node_id] = n.disk.durable
        return n

    def member_ids(self) -> list[int]:
        return [i for i, n in self.nodes.items() if not n.removed]

    def client_targets(self) -> list[int]:
        """Nodes a client may contact: those in some live node's configuration. A node whose
        ADD_LEARNER entry was truncated by a new leader is never contacted by the cluster;
        a client that kept choosing it would only ever be told "no leader known"."""
        conf: set[int] = set()
        for n in self.nodes.values():
            if n.alive and not n.removed:
                conf.update(n.core.voters)
                conf.update(n.core.learners)
        ids = [i for i in self.member_ids() if i in conf]
        return ids or self.member_ids()

    def leader_id(self) -> int | None:
        """The live leader with the highest term, if any."""
        best = None
        for i, n in self.nodes.items():
            if (
                n.alive
                and not n.paused
                and n.core.role == Role.LEADER
                and (best is None or n.core.term > self.nodes[best].core.term)
            ):
                best = i
        return best

    # -- network -------------------------------------------------------------------------------

    def send(self, m) -> None:
        self.trace.append((self.now, "msg", m.frm, m))
        delays = self.net.delays(m.frm, m.to)
        if not delays:
            return
        # Every message crosses the real wire encoding.
        m = decode_message(encode_message(m))
        node = self.nodes.get(m.to)
        if node is None:
            return
        for d in delays:
            self.schedule(d, node.deliver, m)
        late = self.replay_snapshots.get(m.to) if type(m) is InstallSnapshot else None
        if late is not None:
            # A delayed duplicate. Half the time the follower snapshots just before it lands,
            # so the stale one is older than its compacted log as well as its commit index.
            self.stale_snapshots += 1
            if self.rng.random() < 0.5:
                self.schedule(max(delays) + late - 0.001, node.take_snapshot)
            self.schedule(max(delays) + late, node.deliver, m)

    def client_send(self, node_id: int, client: SimClient, req_id: int, op: tuple) -> None:
        node = self.nodes[node_id]
        self.schedule(
            self.cfg.client_delay * (1 + self.rng.random()), node.on_request, client, req_id, op
        )

    # -- faults (used by the nemesis and by scripted tests) ------------------------------------

    def durables_refresh(self) -> None:
        for i, n in self.nodes.items():
            self.durables[i] = n.disk.durable

    def crash(self, node_id: int) -> None:
        self.nodes[node_id].crash()
        self.durables_refresh()

    def restart(self, node_id: int) -> None:
        self.nodes[node_id].restart()
        self.durables_refresh()

    def heal_network(self) -> None:
        self.net.heal()

    # -- running -------------------------------------------------------------------------------

    def _reference_tick(self) -> None:
        # Keep the snapshot-equivalence reference behind every live node.
        live = [n.applied for n in self.nodes.values() if n.alive and not n.removed]
        if live:
            self.inv.advance_reference(min(live))
        self.schedule(1.0, self._reference_tick)

    def add_client(self) -> SimClient:
        """A client for scripted scenarios: queue operations with :meth:`SimClient.submit`."""
        c = SimClient(self, len(self.clients) + 1)
        c.scripted_only = True
        self.clients.append(c)
        return c

    def check_history(self, timeout_s: float = 20.0):
        """Linearizability of the client history so far (a CheckResult)."""
        return check(KvModel(), self.history.operations(), timeout_s=timeout_s)

    def start_clients(self) -> None:
        for i in range(self.cfg.n_clients):
            c = SimClient(self, i + 1)
            self.clients.append(c)
            c.start()

    def run(self) -> SimResult:
        """A full randomised run: workload + nemesis, heal, liveness, final reads, checks."""
        from .nemesis import Nemesis

        t0 = time.perf_counter()
        cfg = self.cfg
        res = SimResult(seed=cfg.seed, ok=True, profile=cfg.profile)
        try:
            self.schedule(1.0, self._reference_tick)
            self.start_clients()
            if cfg.nemesis:
                self.nemesis = Nemesis(self, random.Random(self.rng.random()), cfg.faults)
                self.nemesis.start()
            self.run_until(cfg.duration)
            self.finish_run(res)
        except SimViolation as v:
            res.ok = False
            res.violation = v.invariant
            res.detail = v.detail
        except Exception as e:  # a crash of the core or the harness is a failure too
            import traceback

            res.ok = False
            res.violation = f"exception:{type(e).__name__}"
            res.detail = "".join(traceback.format_exception(e))
        if not res.ok:
            res.trace = self.format_trace(120)
        self._fill_stats(res)
        res.wall_s = time.perf_counter() - t0
        return res

    def _fill_stats(self, res: SimResult) -> None:
        res.ops_ok, res.ops_unknown, res.ops_failed = self.ops_ok, self.ops_unknown, self.ops_failed
        res.writes_acked = self.writes_acked
        res.elections, res.crashes, res.snapshots = self.elections, self.crashes, self.snapshots
        res.snapshots_replayed = self.inv.snapshots_replayed
        res.stale_snapshots = self.stale_snapshots
        res.figure8 = self.inv.figure8
        res.contested_votes = self.contested_votes
        res.messages = self.net.sent
        res.max_term = max(n.core.term for n in self.nodes.values())
        res.commit_index = max(n.core.log.committed for n in self.nodes.values())
        res.faults = list(self.faults_applied)
        res.virtual_s = self.now

    def check_lease_overlap(self, node_id: int) -> None:
        """Leases (thesis §6.4.1): while clock rates stay within ``lease_drift_bound`` of
        each other, no node becomes leader while another still holds a valid lease (vote
        suppression is what guarantees it; a paused node's lease is judged when it
        resumes, after its missed ticks)."""
        cfg = self.cfg
        raft = cfg.raft
        if not cfg.internal_checks or raft.read_only_option is not ReadOnlyOption.LEASE_BASED:
            return
        live = [n for n in self.nodes.values() if n.alive]
        drifts = [n.drift for n in live]
        if max(drifts) > min(drifts) * (1.0 + raft.lease_drift_bound):
            return
        for n in live:
            if (
                n.id != node_id
                and not n.paused
                and n.core.role == Role.LEADER
                and n.core.lease_valid()
            ):
                raise SimViolation(
                    "lease-overlap",
                    f"node {node_id} became leader (term {self.nodes[node_id].core.term}) "
                    "while leader "
                    f"{n.id} (term {n.core.term}) still holds a valid lease",
                )

    def check_churn(self, node_id: int) -> None:
        """Invariant 15: with pre-vote and check-quorum, once a stable window has settled
        (2 x election_max after the faults ended) leadership does not move."""
        nem = self.nemesis
        raft = self.cfg.raft
        if nem is None or nem.stable_since is None or not (raft.pre_vote and raft.check_quorum):
            return
        if not self.cfg.internal_checks or self.stopping:
            return
        if self.now > max(nem.stable_since, self.stall_until) + 2 * self.cfg.election_max_s:
            raise SimViolation(
                "leader-churn",
                f"node {node_id} became leader (term {self.nodes[node_id].core.term}) "
                f"{self.now - nem.stable_since:.2f}s into a stable window",
            )

    def heal_all(self) -> None:
        """End every fault: network healed, clocks reset, paused nodes resumed, crashed
        members restarted."""
        if self.nemesis is not None:
            self.nemesis.stop()
        self.net.heal()
        for n in self.nodes.values():
            n.drift = 1.0
            n.fsync_factor = 1.0
            if n.paused:
                n.resume()
        for i, n in list(self.nodes.items()):
            if not n.alive and not n.removed:
                self.restart(i)

    def finish_run(self, res: SimResult) -> None:
        cfg = self.cfg
        self.stopping = True
        self.heal_all()
        em = cfg.election_max_s
        # Stable period: clients drain; the cluster must settle.
        self.run_until(self.now + max(3 * em, cfg.op_deadline + 1.0))
        pending: SimViolation | None = None
        try:
            self.check_liveness(em)
            self.final_read_all()
        except SimViolation as v:
            pending = v
        # Client-visible checks first (also when the cluster is wedged): they are what a
        # negative control must trip.
        self.check_client_history(res)
        if pending is not None:
            raise pending
        self.check_convergence()
        self.check_end()

    def check_liveness(self, em: float) -> None:
        """Invariant 14: one leader, and a new write commits within 2 x election_max."""
        leaders = [
            i
            for i, n in self.nodes.items()
            if n.alive and not n.removed and n.core.role == Role.LEADER
        ]
        if len(leaders) != 1:
            raise SimViolation(
                "liveness", f"after healing and {3 * em:.1f}s of stability: leaders {leaders}"
            )
        probe = SimClient(self, 10_000)
        probe.records_final = True
        probe.scripted_only = True
        done: list = []
        probe.done_callbacks.append(done.append)
        self.clients.append(probe)
        probe.next_op()  # registers (itself a write through the log)
        deadline = self.now + 2 * em + 1.0
        while not done and self.now < deadline:
            self.run_until(self.now + 0.05)
        if not done or probe.cid is None:
            raise SimViolation(
                "liveness", f"a write did not commit within {2 * em + 1.0:.1f}s after healing"
            )
        self.probe = probe

    def final_read_all(self) -> None:
        """Read every key through the leader (ReadIndex) and record it in the history."""
        probe = self.probe
        keys = [f"k{i}" for i in range(self.cfg.n_keys)]
        probe.done_callbacks = []
        for k in keys:
            probe.scripted.append(("get", k, None, False))
        self.final_reads.clear()
        probe.next_op()
        deadline = self.now + len(keys) * (self.cfg.op_deadline + 1.0)
        while (probe.scripted or probe.op is not None) and self.now < deadline:
            self.run_until(self.now + 0.05)
        missing = [k for k in keys if k not in self.final_reads]
        if missing:
            raise SimViolation("liveness", f"final reads of {missing} did not complete")

    def check_convergence(self) -> None:
        """All live members apply the same log and reach the same state."""
        em = self.cfg.election_max_s
        deadline = self.now + 2 * em
        members = [
            n
            for n in self.nodes.values()
            if n.alive and not n.removed and n.core.id in self._current_voters_and_learners()
        ]
        while self.now < deadline:
            target = max(n.core.log.committed for n in members)
            if all(n.applied >= target for n in members):
                break
            self.run_until(self.now + 0.1)
        applied = {n.id: n.applied for n in members}
        if len(set(applied.values())) != 1 and self.cfg.internal_checks:
            raise SimViolation("convergence", f"replicas did not converge: applied {applied}")
        digests = {n.id: state_digest(n.sm) for n in members}
        if len(set(digests.values())) != 1 and self.cfg.internal_checks:
            raise SimViolation(
                "state-machine-safety", f"replicas at the same index differ: {digests}"
            )

    def _current_voters_and_learners(self) -> set[int]:
        lid = self.leader_id()
        if lid is None:
            return set(self.member_ids())
        c = self.nodes[lid].core
        return set(c.voters) | set(c.learners)

    def check_end(self) -> None:
        inv = self.inv
        if self.cfg.internal_checks:
            inv.advance_reference(inv.max_applied)
            Invariants.check_log_matching(
                {i: Invariants.log_of(n.core) for i, n in self.nodes.items() if n.alive}
            )

    def check_client_history(self, res: SimResult) -> None:
        """Invariants 10-12 on what clients saw."""
        ops = self.history.operations()
        # The search-free check understands put/delete only: leave keys with CAS writes to
        # the linearizability checker.
        cas_keys = {o.input.key for o in ops if o.input.op == "cas"}
        lost = lost_acknowledged_writes(
            [o for o in ops if o.input.key not in cas_keys], self.final_reads
        )
        if lost:
            raise SimViolation("lost-acknowledged-write", "; ".join(lost[:5]))
        if self.cfg.check_linearizability:
            r = check(KvModel(), ops, timeout_s=self.cfg.lin_timeout)
            res.lin_outcome = r.outcome
            if r.outcome == "illegal":
                raise SimViolation("linearizability", r.report(max_ops=40))
            if r.outcome == "unknown":
                raise SimViolation("linearizability-budget", r.report(max_ops=10))
        if self.ledger.violations:
            raise SimViolation("exactly-once", "; ".join(self.ledger.violations[:5]))
        if self.session_rejections:
            # Sessions never expire in the simulator: a rejection means the table was lost.
            raise SimViolation(
                "lost-session",
                "session rejected a live client: " + "; ".join(self.session_rejections[:3]),
            )

    def format_trace(self, n: int) -> list[str]:
        out = []
        for t, kind, node, detail in list(self.trace)[-n:]:
            if kind == "msg":
                out.append(f"{t:9.4f} msg  {detail!r}"[:300])
            else:
                out.append(f"{t:9.4f} {kind:5} node {node} {detail}")
        return out


def run_seed(seed: int, profile: str = "ci", **overrides: Any) -> SimResult:
    """Run the randomised simulation for ``seed`` (with optional SimConfig overrides)."""
    cfg = SimConfig.generate(seed, profile)
    if overrides:
        cfg = msgspec.structs.replace(cfg, **overrides)
    return Simulator(cfg).run()


def run_seed_args(args: tuple[int, str, dict]) -> SimResult:
    """``run_seed`` taking one tuple (for process pools)."""
    seed, profile, overrides = args
    return run_seed(seed, profile, **overrides)
