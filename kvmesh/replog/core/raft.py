"""The sans-I/O Raft core: a deterministic state machine shaped like etcd-raft's RawNode, with
raft-rs's split of outgoing messages into "send now" and "send after persist".

It owns no socket, clock, thread, file or global randomness. A driver feeds it ticks
(:meth:`RaftCore.tick`), peer messages (:meth:`step`) and requests (:meth:`propose`,
:meth:`propose_conf_change`, :meth:`read_index`, :meth:`transfer_leader`), and repeatedly
handles its output::

    while core.has_ready():
        rd = core.ready()
        storage: apply rd.snapshot_to_install, append rd.entries_to_append, set rd.hard_state
        send rd.send_now               (may overlap with the fsync)
        fsync if rd.must_sync
        send rd.send_after_persist
        restore the state machine from rd.snapshot_to_install; apply rd.committed_entries
        core.advance(rd)

Messages may be stepped in while a Ready is being handled; only one Ready is outstanding
at a time. Everything in ``committed_entries`` is durable locally and on a quorum.

Features: leader election with pre-vote and check-quorum; pipelined, batched replication
with probe/replicate/snapshot flow control; commitment by counting only current-term
entries (paper Figure 8); fast conflict back-off; snapshots and compacted-log handling; leader
transfer; ReadIndex and lease reads, also for followers; single-server membership changes
with learners. See ``docs/replog.md`` for the design and the test matrix.
"""

from __future__ import annotations

import random

import msgspec

from ..types import (
    ENTRY_OVERHEAD,
    NONE,
    Append,
    AppendResp,
    ConfChange,
    ConfChangeError,
    ConfChangeType,
    ConfState,
    Entry,
    EntryKind,
    HardState,
    Heartbeat,
    HeartbeatResp,
    InstallSnapshot,
    InstallSnapshotResp,
    LeaderTransferError,
    LogCompacted,
    LogStorage,
    LogUnavailable,
    NotLeader,
    PreVote,
    PreVoteResp,
    ProposalDropped,
    ProposalTooLarge,
    RaftConfig,
    ReadIndex,
    ReadIndexResp,
    ReadOnlyOption,
    ReadState,
    Ready,
    ReadyContractError,
    Role,
    Snapshot,
    SnapshotTemporarilyUnavailable,
    SoftState,
    Status,
    TimeoutNow,
    Vote,
    VoteResp,
    decode_conf_change,
    encode_conf_change,
)
from .log import RaftLog
from .progress import (
    PROBE,
    REPLICATE,
    SNAPSHOT,
    VOTE_LOST,
    VOTE_WON,
    Progress,
    committed_index,
    quorum_size,
    vote_result,
)
from .readonly import ReadOnly

__all__ = ["RaftCore", "next_conf_state"]


def next_conf_state(cs: ConfState, cc: ConfChange) -> ConfState:
    """The configuration after applying ``cc`` to ``cs`` (the one rule the core and drivers
    share: a driver tracks the configuration entry by entry as it applies, so that a
    snapshot records the configuration at exactly its index)."""
    voters = set(cs.voters)
    learners = set(cs.learners)
    n, t = cc.node_id, cc.type
    if t == ConfChangeType.ADD_VOTER or (t == ConfChangeType.PROMOTE_LEARNER and n in learners):
        learners.discard(n)
        voters.add(n)
    elif t == ConfChangeType.ADD_LEARNER:
        if n not in voters:
            learners.add(n)
    elif t == ConfChangeType.REMOVE_NODE:
        if voters - {n}:
            voters.discard(n)
        learners.discard(n)
    return ConfState(tuple(sorted(voters)), tuple(sorted(learners)))


FOLLOWER = Role.FOLLOWER
PRE_CANDIDATE = Role.PRE_CANDIDATE
CANDIDATE = Role.CANDIDATE
LEADER = Role.LEADER

_NORMAL = int(EntryKind.NORMAL)
_CONF_CHANGE = int(EntryKind.CONF_CHANGE)

# Responses that acknowledge state (entries, votes, an installed snapshot): they may only
# leave once everything stepped before them is durable.
_AFTER_PERSIST = (AppendResp, VoteResp, PreVoteResp, InstallSnapshotResp)
_LEADER_MSGS = (Append, Heartbeat, InstallSnapshot)
_ENTRY_KINDS = frozenset(int(k) for k in EntryKind)


def _valid_conf_change(data: bytes) -> bool:
    try:
        cc = decode_conf_change(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return cc.node_id > 0 and cc.type in _CC_TYPES


_CC_TYPES = frozenset(int(t) for t in ConfChangeType)


class RaftCore:
    """One Raft replica's protocol state (see the module docstring for the driver loop).

    ``storage`` is read-only from the core's side; ``rng`` randomises election timeouts (a
    seeded ``random.Random`` makes runs reproducible); ``applied`` is the index the
    application's state machine already reflects on start (default: the storage's snapshot
    index).
    """

    def __init__(
        self,
        node_id: int,
        storage: LogStorage,
        config: RaftConfig | None = None,
        rng: random.Random | None = None,
        applied: int | None = None,
    ) -> None:
        if node_id <= 0:
            raise ValueError(f"node ids must be positive, got {node_id}")
        self.id = node_id
        self.cfg = cfg = config or RaftConfig()
        self.rng = rng if rng is not None else random.Random(node_id)
        self.storage = storage
        self._lease_ticks = cfg.lease_ticks
        self._lease_mode = cfg.read_only_option is ReadOnlyOption.LEASE_BASED
        e_lo, e_hi = cfg.election_range
        self._election_lo, self._election_hi = e_lo, e_hi
        self._snapshot_timeout = cfg.snapshot_timeout_tick or 4 * cfg.election_tick

        hs, cs = storage.initial_state()
        snap_index = storage.first_index() - 1
        if applied is None:
            applied = snap_index
        last = storage.last_index()
        if not snap_index <= applied <= last:
            raise ValueError(
                f"applied index {applied} outside the stored log [{snap_index}, {last}]"
            )
        if hs.commit > last:
            raise ValueError(f"hard state commit {hs.commit} beyond the last stored index {last}")
        self.log = RaftLog(storage, applied)
        self.log.committed = max(hs.commit, applied, snap_index)

        self.voters: tuple[int, ...] = tuple(sorted(cs.voters))
        self.learners: tuple[int, ...] = tuple(sorted(cs.learners))
        # The state machine already reflects entries up to ``applied``; replay their
        # membership changes so the configuration matches it.
        if applied > snap_index:
            for e in storage.entries(snap_index + 1, applied + 1):
                if e.kind == _CONF_CHANGE:
                    self._apply_conf_change_to_sets(decode_conf_change(e.data))

        self.term = hs.term
        self.vote = hs.vote
        self.role = FOLLOWER
        self.lead = NONE
        self.lead_transferee = NONE
        self.election_elapsed = 0
        self.heartbeat_elapsed = 0
        self.randomized_election_timeout = e_lo
        self.votes: dict[int, bool] = {}
        self._campaign_transfer = False  # whether the campaign under way is a transfer
        self._yielded_term = -1  # the term in which this node last gave up a pre-campaign
        self.prs: dict[int, Progress] = {}
        self._peer_ids: tuple[int, ...] = ()
        self.readonly = ReadOnly()
        self.pending_conf_index = 0
        self.uncommitted_size = 0
        self._need_flush = False
        self._commit_dirty = False
        self._lease_revoked = False
        self._ticks = 0  # ticks since this core was created (monotonic; leases, boot guard)
        self.dropped_msgs = 0  # messages refused by the validation in step()

        self.msgs_now: list = []
        self.msgs_after: list = []
        self.read_states: list[ReadState] = []
        self._prev_hs = hs
        self._durable_term = hs.term
        self._durable_vote = hs.vote
        self._prev_ss = SoftState(NONE, int(FOLLOWER))
        self._outstanding: Ready | None = None

        self._become_follower(self.term, NONE)

    # ======================================================================================
    # Driver API
    # ======================================================================================

    def tick(self) -> None:
        """Advance logical time by one tick.

        Drivers call this once per elapsed tick interval of a *monotonic* clock, and after a
        stall (GC pause, blocked event loop, SIGSTOP) they first deliver every missed tick
        before stepping messages or calling :meth:`read_index`: leases are measured in
        ticks, and a lease must not outlive a freeze."""
        self._ticks += 1
        if self.role == LEADER:
            self._tick_leader()
        else:
            self._tick_election()

    def campaign(self) -> None:
        """Start an election now (tests and operator tools; normally ticks do this)."""
        self._hup(transfer=False)

    def step(self, m) -> None:
        """Feed one message received from a peer.

        Messages are validated against this node's state first; a malformed one (entries
        that do not continue ``prev_index``, an acknowledgement beyond our log, a transfer
        vote or ``TimeoutNow`` outside a leadership transfer, ...) is dropped and counted
        in :attr:`dropped_msgs`, never raised: peers are not trusted to be well-formed."""
        if m.to != self.id or m.frm == self.id:
            return
        mt = type(m)
        if not self._valid(m, mt):
            self.dropped_msgs += 1
            return
        if m.term > self.term:
            if mt is Vote or mt is PreVote:
                if m.frm not in self.voters:
                    return  # removed or unknown nodes cannot disrupt the cluster
                if self._in_lease() and not (mt is Vote and self._transfer_vote(m)):
                    return  # we heard from a live leader recently (thesis §4.2.3)
            if mt is PreVote:
                pass  # a pre-vote never changes our term
            elif mt is PreVoteResp and not m.reject:
                pass  # the term in a granted pre-vote is the one we will campaign in
            elif mt in _LEADER_MSGS:
                self._become_follower(m.term, m.frm)
            else:
                self._become_follower(m.term, NONE)
        elif m.term < self.term:
            if mt is Append or mt is Heartbeat:
                # Paper §5.1: reject with our term so that a stale leader steps down (with
                # pre-vote nobody else would ever raise its term to tell it).
                self._send(AppendResp(self.id, m.frm, self.term, index=0))
            elif mt is PreVote:
                self._send(PreVoteResp(self.id, m.frm, self.term, reject=True))
            return

        if mt is Vote or mt is PreVote:
            self._handle_vote_request(m, mt is PreVote)
            return
        role = self.role
        if role == LEADER:
            self._step_leader(m, mt)
        elif role == FOLLOWER:
            self._step_follower(m, mt)
        else:
            self._step_candidate(m, mt)

    def _valid(self, m, mt) -> bool:
        """Structural checks of one message against this node's state (see :meth:`step`)."""
        if m.frm <= 0 or m.term < 0:
            return False
        if mt is Append:
            return self._valid_append(m)
        if mt is AppendResp:
            if m.term != self.term or self.role != LEADER:
                return True  # stale or term-raising: handled by the term rules
            last = self.log.last_index()
            # A success acknowledges entries we sent (all in our log); a rejection names
            # the prev_index of an Append we sent.
            return 0 <= m.index <= last and m.hint_index >= 0 and 0 <= m.hint_term <= self.term
        if mt is InstallSnapshotResp:
            return (
                m.term != self.term or self.role != LEADER or 0 <= m.index <= self.log.last_index()
            )
        if mt is InstallSnapshot:
            return self._valid_snapshot(m)
        if mt is Heartbeat:
            return m.commit >= 0 and m.ctx >= 0
        if mt is TimeoutNow:
            # Only the leader we follow, in our term, hands leadership over (its target is
            # caught up, so it already follows that leader in that term). A TimeoutNow that
            # would raise our term or comes from anyone else is not a transfer.
            return m.term == self.term and m.frm == self.lead and self.role == FOLLOWER
        if mt is ReadIndexResp:
            return m.term != self.term or (m.frm == self.lead and m.index >= 0)
        if mt is Vote or mt is PreVote:
            return m.last_index >= 0 and 0 <= m.last_term <= m.term
        return True

    def _valid_append(self, m: Append) -> bool:
        if m.prev_index < 0 or not 0 <= m.prev_term <= m.term or m.commit < 0:
            return False
        ents = m.entries
        if not ents:
            return True
        # Entries continue prev_index without gaps, with terms that never decrease, start
        # at or above prev_term and never exceed the sender's term.
        i = m.prev_index
        t = m.prev_term
        for e in ents:
            i += 1
            if e.index != i or e.term < t or e.kind not in _ENTRY_KINDS:
                return False
            t = e.term
            if e.kind == _CONF_CHANGE and not _valid_conf_change(e.data):
                return False
        return t <= m.term

    def _valid_snapshot(self, m: InstallSnapshot) -> bool:
        meta = m.snapshot.meta
        if meta.index <= 0 or not 0 < meta.term <= m.term:
            return False
        cs = meta.conf_state
        ids = (*cs.voters, *cs.learners)
        return bool(cs.voters) and all(n > 0 for n in ids) and len(set(ids)) == len(ids)

    def _transfer_vote(self, m: Vote) -> bool:
        """Whether ``m`` may bypass the follower lease as part of a leadership transfer:
        the target of a TimeoutNow campaigns at exactly the next term of the leader it (and
        we) followed. A transfer flag claiming any other term is not a transfer (it would
        otherwise let one message push every term arbitrarily high)."""
        return m.transfer and self.lead != NONE and m.term == self.term + 1

    def snapshot_needed(self, m: InstallSnapshot) -> bool:
        """Whether stepping ``m`` would make this node install its snapshot (replace the
        log). Drivers prove the image - restore it into a fresh state machine - before
        stepping such a message, so that only a usable snapshot is ever persisted."""
        if m.to != self.id or m.frm == self.id or m.term < self.term or not self._valid_snapshot(m):
            return False
        meta = m.snapshot.meta
        return meta.index > self.log.committed and not self.log.match_term(meta.index, meta.term)

    def propose(self, data: bytes) -> int:
        """Append a command to the leader's log; returns its index (the entry's term is the
        current ``term``: if a different entry is later committed at that index, the
        proposal was lost). Raises NotLeader, ProposalDropped or ProposalTooLarge."""
        self._check_can_propose()
        size = len(data) + ENTRY_OVERHEAD
        if size > self.cfg.max_size_per_msg:
            raise ProposalTooLarge(
                f"entry of {size} bytes exceeds max_size_per_msg={self.cfg.max_size_per_msg}"
            )
        self._charge_uncommitted(size)
        idx = self.log.last_index() + 1
        self.log.u_entries.append(Entry(self.term, idx, _NORMAL, data))
        self._need_flush = True
        return idx

    def propose_many(self, datas: list[bytes]) -> int:
        """Propose several commands at once (all or none); returns the last index."""
        if not datas:
            raise ValueError("propose_many needs at least one command")
        self._check_can_propose()
        cap = self.cfg.max_size_per_msg
        total = 0
        for d in datas:
            size = len(d) + ENTRY_OVERHEAD
            if size > cap:
                raise ProposalTooLarge(f"entry of {size} bytes exceeds max_size_per_msg={cap}")
            total += size
        self._charge_uncommitted(total)
        term = self.term
        idx = self.log.last_index()
        self.log.u_entries.extend(
            [Entry(term, idx + i, _NORMAL, d) for i, d in enumerate(datas, 1)]
        )
        self._need_flush = True
        return idx + len(datas)

    def propose_conf_change(self, cc: ConfChange) -> int:
        """Propose a single-server membership change; returns its index. Refused while
        another change is uncommitted/unapplied, or before this leader has committed an
        entry of its term (Ongaro's correction); ConfChangeError if invalid."""
        self._check_can_propose()
        if self.log.zero_term(self.log.committed) != self.term:
            raise ProposalDropped(
                "the leader has not committed an entry of its term yet; retry shortly"
            )
        if self.pending_conf_index > self.log.applied:
            raise ProposalDropped(
                "a configuration change is pending "
                f"(index {self.pending_conf_index}, applied {self.log.applied})"
            )
        self._validate_conf_change(cc)
        data = encode_conf_change(cc)
        self._charge_uncommitted(len(data) + ENTRY_OVERHEAD)
        idx = self.log.last_index() + 1
        self.log.u_entries.append(Entry(self.term, idx, _CONF_CHANGE, data))
        self.pending_conf_index = idx
        self._need_flush = True
        return idx

    def read_index(self, ctx: bytes) -> None:
        """Request a linearizable read point; the answer arrives as a ReadState(index, ctx)
        in a later Ready (serve the read once applied >= index). Requests are dropped if
        leadership changes before they are confirmed: drivers fail them on a soft-state
        change or by timeout. Raises NotLeader if no leader is known."""
        if self.role == LEADER:
            self._leader_read(ctx, self.id)
        elif self.lead == NONE:
            raise NotLeader(None, "no leader known; cannot obtain a read index")
        else:
            self._send(ReadIndex(self.id, self.lead, self.term, ctx))

    def transfer_leader(self, to: int) -> None:
        """Hand leadership to voter ``to`` (it is caught up first); proposals are refused
        until the transfer completes or times out (one election timeout)."""
        if self.role != LEADER:
            raise NotLeader(self.lead or None)
        if to == self.id:
            return
        if to not in self.voters:
            raise LeaderTransferError(
                f"cannot transfer leadership to {to}: not a voter of {self.voters}"
            )
        if self.lead_transferee == to:
            return
        self.lead_transferee = to
        self.election_elapsed = 0
        pr = self.prs[to]
        if pr.match == self.log.last_index():
            self._send_timeout_now(to)
        else:
            self._send_append(to, pr)

    def report_unreachable(self, peer: int) -> None:
        """The transport failed to deliver to ``peer``: stop pipelining to it."""
        if self.role == LEADER:
            pr = self.prs.get(peer)
            if pr is not None and pr.state == REPLICATE:
                pr.become_probe()

    def report_snapshot(self, peer: int, ok: bool) -> None:
        """The transport finished (ok) or failed to send a snapshot to ``peer``."""
        if self.role != LEADER:
            return
        pr = self.prs.get(peer)
        if pr is None or pr.state != SNAPSHOT:
            return
        if not ok:
            pr.pending_snapshot = 0
        pr.become_probe()
        # Wait for a heartbeat answer before probing (the peer may still be installing).
        pr.probe_sent = True

    def has_ready(self) -> bool:
        if self._outstanding is not None:
            return False
        self._flush()
        log = self.log
        if (
            self.msgs_now
            or self.msgs_after
            or self.read_states
            or log.u_entries
            or log.u_snapshot is not None
        ):
            return True
        hs = self._prev_hs
        if hs.term != self.term or hs.vote != self.vote or hs.commit != log.committed:
            return True
        ss = self._prev_ss
        if ss.leader != self.lead or ss.role != self.role:
            return True
        return log.has_next_committed_entries()

    def ready(self) -> Ready:
        """The pending work; must be followed by :meth:`advance` before the next call."""
        if self._outstanding is not None:
            raise ReadyContractError("ready() called again before advance() of the previous Ready")
        self._flush()
        log = self.log
        hs = HardState(self.term, self.vote, log.committed)
        prev = self._prev_hs
        rd_hs = None
        must_sync = False
        if hs != prev:
            rd_hs = hs
            must_sync = hs.term != prev.term or hs.vote != prev.vote
            self._prev_hs = hs
        ss = self._prev_ss
        rd_ss = None
        if ss.leader != self.lead or ss.role != self.role:
            rd_ss = self._prev_ss = SoftState(self.lead, int(self.role))
        ents = list(log.u_entries)
        snap = log.u_snapshot
        committed = log.next_committed_entries(self.cfg.max_committed_size_per_ready)
        if committed:
            log.applying = committed[-1].index
        rd = Ready(
            hard_state=rd_hs,
            entries_to_append=ents,
            snapshot_to_install=snap,
            send_now=self.msgs_now,
            send_after_persist=self.msgs_after,
            committed_entries=committed,
            read_states=self.read_states,
            soft_state=rd_ss,
            must_sync=must_sync or bool(ents) or snap is not None,
        )
        self.msgs_now = []
        self.msgs_after = []
        self.read_states = []
        self._outstanding = rd
        return rd

    def take_send_now(self) -> list:
        """Leader with a Ready outstanding: the messages that may go out before any fsync
        (appends of entries proposed since that Ready, heartbeats), so that the driver
        replicates new entries while the Ready's fsync runs instead of after it. The leader
        counts its own copy toward commitment only once a later Ready persisted it (a leader
        may write its log in parallel with replicating it: thesis §10.2.1). Empty otherwise
        (without a Ready outstanding, :meth:`ready` hands these out)."""
        if self._outstanding is None or self.role != LEADER:
            return []
        self._flush()
        msgs = self.msgs_now
        self.msgs_now = []
        return msgs

    def advance(self, rd: Ready) -> None:
        """Everything in ``rd`` is durably persisted and applied."""
        if rd is not self._outstanding:
            raise ReadyContractError(
                "advance() called with a Ready that is not the outstanding one"
            )
        self._outstanding = None
        log = self.log
        if rd.hard_state is not None:
            self._durable_term = rd.hard_state.term
            self._durable_vote = rd.hard_state.vote
        snap = rd.snapshot_to_install
        if snap is not None:
            log.stable_snap_to(snap.meta.index)
            if snap.meta.index > log.applied:
                log.applied = log.applying = snap.meta.index
        if rd.entries_to_append:
            last = rd.entries_to_append[-1]
            log.stable_to(last.index, last.term)
        ents = rd.committed_entries
        if ents:
            log.applied = ents[-1].index
            if log.applying < log.applied:
                log.applying = log.applied
            if self.role == LEADER and self.uncommitted_size:
                size = sum([len(e.data) for e in ents]) + ENTRY_OVERHEAD * len(ents)
                self.uncommitted_size = max(0, self.uncommitted_size - size)
            for e in ents:
                if e.kind == _CONF_CHANGE:
                    self._apply_conf_change(decode_conf_change(e.data))
        if self.role == LEADER:
            me = self.prs.get(self.id)
            if me is not None:
                me.match = log.persisted
                me.next = log.last_index() + 1
            self._maybe_commit()

    def status(self) -> Status:
        log = self.log
        progress = {}
        if self.role == LEADER:
            progress = {i: pr.status() for i, pr in sorted(self.prs.items())}
        return Status(
            id=self.id,
            term=self.term,
            vote=self.vote,
            commit=log.committed,
            applied=log.applied,
            role=int(self.role),
            leader=self.lead,
            first_index=log.first_index(),
            last_index=log.last_index(),
            persisted_index=log.persisted,
            conf_state=self.conf_state,
            lead_transferee=self.lead_transferee,
            progress=progress,
        )

    @property
    def conf_state(self) -> ConfState:
        """The configuration as of the last applied entry (what a snapshot taken now must
        record)."""
        return ConfState(self.voters, self.learners)

    @property
    def is_leader(self) -> bool:
        return self.role == LEADER

    @property
    def ticks(self) -> int:
        return self._ticks

    def lease_valid(self) -> bool:
        """Whether a leader may answer reads from its lease right now (LEASE_BASED)."""
        return (
            self.role == LEADER
            and self._lease_mode
            and self._committed_in_term()
            and self._lease_valid()
        )

    # ======================================================================================
    # Internals: sending and flushing
    # ======================================================================================

    def _send(self, m) -> None:
        if (
            type(m) in _AFTER_PERSIST
            or self.term != self._durable_term
            or self.vote != self._durable_vote
        ):
            self.msgs_after.append(m)
        else:
            self.msgs_now.append(m)

    def _flush(self) -> None:
        """Leader: turn deferred work (new proposals, commit advances, queued reads) into
        messages, once per Ready so that proposals between Readies share Appends."""
        if self.role != LEADER:
            return
        if self._need_flush or self._commit_dirty:
            # Followers learn the commit index from the next Append or heartbeat; an empty
            # Append just for it is sent only when forced (stepping down), which keeps the
            # message count per batch at one round trip.
            commit_dirty = self._commit_dirty
            self._need_flush = self._commit_dirty = False
            for pid in self._peer_ids:
                pr = self.prs[pid]
                sent = False
                while self._send_append(pid, pr, send_if_empty=False):
                    sent = True
                if not sent and commit_dirty:
                    self._send_append(pid, pr, send_if_empty=True)
        if self.readonly.unsent:
            self._bcast_heartbeat()

    def _send_append(self, to: int, pr: Progress, send_if_empty: bool = True) -> bool:
        if pr.is_paused():
            return False
        log = self.log
        prev = pr.next - 1
        last = log.last_index()
        try:
            prev_term = log.term(prev)
            ents = (
                log.entries(pr.next, last + 1, self.cfg.max_size_per_msg) if pr.next <= last else []
            )
        except LogCompacted:
            return self._send_snapshot(to, pr)
        except LogUnavailable:
            # The peer claims more than we have (it answered a previous leader): restart
            # the search from our end.
            pr.next = last + 1
            return False
        n = len(ents)
        if not n and not send_if_empty:
            return False
        self._send(Append(self.id, to, self.term, prev, prev_term, log.committed, ents))
        nbytes = 0
        if n and pr.inflights.max_bytes:
            nbytes = sum([len(e.data) for e in ents]) + ENTRY_OVERHEAD * n
        pr.sent_entries(ents[-1].index if n else prev, n, nbytes)
        return True

    def _send_snapshot(self, to: int, pr: Progress) -> bool:
        if not pr.recent_active:
            return False
        try:
            snap = self.storage.snapshot()
        except SnapshotTemporarilyUnavailable:
            return False
        if snap.meta.index == 0:
            return False
        pr.become_snapshot(snap.meta.index)
        self._send(InstallSnapshot(self.id, to, self.term, snap))
        return True

    def _send_timeout_now(self, to: int) -> None:
        # The target will be granted votes despite follower leases: stop serving lease
        # reads for the rest of this term.
        self._lease_revoked = True
        self._send(TimeoutNow(self.id, to, self.term))

    def _bcast_heartbeat(self) -> None:
        r = self.readonly.open_round(self._ticks, self.log.committed, self._lease_ticks)
        commit = self.log.committed
        for pid in self._peer_ids:
            pr = self.prs[pid]
            self._send(Heartbeat(self.id, pid, self.term, min(pr.match, commit), r))
        self._check_read_rounds()

    # ======================================================================================
    # Internals: role transitions and ticks
    # ======================================================================================

    def _reset(self, term: int) -> None:
        if self.term != term:
            self.term = term
            self.vote = NONE
            self._drop_stale_messages(term)
        self.lead = NONE
        self.election_elapsed = 0
        self.heartbeat_elapsed = 0
        self.randomized_election_timeout = self.rng.randrange(self._election_lo, self._election_hi)
        self.lead_transferee = NONE
        self.votes = {}
        self.prs = {}
        self._peer_ids = ()
        self.readonly = ReadOnly()
        self.pending_conf_index = 0
        self.uncommitted_size = 0
        self._need_flush = False
        self._commit_dirty = False
        self._lease_revoked = False

    def _drop_stale_messages(self, term: int) -> None:
        # Queued messages of an older term are void, and acknowledgements among them may
        # promise entries that a newer leader's Append truncates before the next fsync:
        # sent after that fsync they would claim indexes that are not durable (soak seed
        # 700022). Dropping a message is always safe.
        if self.msgs_now:
            self.msgs_now = [m for m in self.msgs_now if m.term >= term]
        if self.msgs_after:
            self.msgs_after = [m for m in self.msgs_after if m.term >= term]

    def _become_follower(self, term: int, lead: int) -> None:
        self._reset(term)
        self.role = FOLLOWER
        self.lead = lead

    def _become_pre_candidate(self) -> None:
        # No term change and no reset: a pre-candidate disturbs nobody.
        self.role = PRE_CANDIDATE
        self.votes = {}
        self.lead = NONE
        self.prs = {}
        self._peer_ids = ()

    def _become_candidate(self) -> None:
        self._reset(self.term + 1)
        self.vote = self.id
        self.role = CANDIDATE

    def _become_leader(self) -> None:
        self._reset(self.term)
        self.role = LEADER
        self.lead = self.id
        log = self.log
        last = log.last_index()
        cfg = self.cfg
        for n in (*self.voters, *self.learners):
            self.prs[n] = Progress(
                last + 1, cfg.max_inflight_msgs, cfg.max_inflight_bytes, n in self.learners
            )
        me = self.prs.get(self.id)
        if me is not None:
            me.match = log.persisted
            me.become_replicate()
            me.next = last + 1
        self._peer_ids = tuple(sorted(n for n in self.prs if n != self.id))
        # Any entry in the log may be a configuration change: no new change until the
        # whole current log is applied.
        self.pending_conf_index = last
        log.u_entries.append(Entry(self.term, last + 1, _NORMAL, b""))
        self._need_flush = True
        self._maybe_commit()  # single-voter clusters

    def _promotable(self) -> bool:
        return self.id in self.voters

    def _in_lease(self) -> bool:
        if not self.cfg.check_quorum or self.election_elapsed >= self.cfg.election_tick:
            return False
        if self.lead != NONE:
            return True
        # A node that just (re)started may have vouched for a leader before it crashed:
        # with lease reads on, it keeps that promise for one election timeout.
        return self._lease_mode and self._ticks < self.cfg.election_tick

    def _tick_election(self) -> None:
        self.election_elapsed += 1
        if self.election_elapsed >= self.randomized_election_timeout and self._promotable():
            self.election_elapsed = 0
            self._hup(transfer=False)
        elif self.role != FOLLOWER and self.election_elapsed % self.cfg.heartbeat_tick == 0:
            # Ask the voters that have not answered again, every heartbeat interval, instead
            # of only at the next election timeout. A voter still inside its leader lease
            # drops a PreVote without answering, and the followers of a dead leader time
            # out a tick or so apart: the first pre-candidate's requests reach the other
            # before its lease lapses, and without this the election waited for the
            # other's own (randomised, up to twice as long) timeout -- most of a store
            # write's pause after a leader kill (docs/replog.md, failover). A request
            # lost with a connection that was being re-established is recovered the same
            # way. Safe: a pre-vote changes nobody's state and a vote is idempotent for
            # one candidate and term.
            self._request_votes(self.role == PRE_CANDIDATE, self._campaign_transfer)

    def _tick_leader(self) -> None:
        self.heartbeat_elapsed += 1
        self.election_elapsed += 1
        for pr in self.prs.values():
            if pr.state == SNAPSHOT:
                pr.state_ticks += 1
                if pr.state_ticks >= self._snapshot_timeout:
                    # No answer to the snapshot: probe again (the next heartbeat answer
                    # triggers a fresh Append or snapshot).
                    pr.become_probe()
        if self.election_elapsed >= self.cfg.election_tick:
            self.election_elapsed = 0
            if self.cfg.check_quorum:
                if not self._quorum_active():
                    self._become_follower(self.term, NONE)
                    return
                for pid in self._peer_ids:
                    self.prs[pid].recent_active = False
            if self.lead_transferee != NONE:
                self.lead_transferee = NONE  # transfer timed out
        if self.heartbeat_elapsed >= self.cfg.heartbeat_tick:
            self.heartbeat_elapsed = 0
            self._bcast_heartbeat()

    def _quorum_active(self) -> bool:
        n = 0
        for v in self.voters:
            if v == self.id:
                n += 1
            else:
                pr = self.prs.get(v)
                if pr is not None and pr.recent_active:
                    n += 1
        return n >= quorum_size(len(self.voters))

    def _has_unapplied_conf_changes(self) -> bool:
        log = self.log
        lo, hi = log.applied + 1, log.committed
        if lo > hi:
            return False
        try:
            ents = log.entries(lo, hi + 1)
        except (LogCompacted, LogUnavailable):
            return True  # be conservative: do not campaign on a config we cannot check
        return any(e.kind == _CONF_CHANGE for e in ents)

    def _hup(self, transfer: bool) -> None:
        if self.role == LEADER or not self._promotable():
            return
        if self._has_unapplied_conf_changes():
            return
        self._campaign(pre=self.cfg.pre_vote and not transfer, transfer=transfer)

    def _campaign(self, pre: bool, transfer: bool) -> None:
        if pre:
            self._become_pre_candidate()
        else:
            self._become_candidate()
        self.votes[self.id] = True
        if vote_result(self.voters, self.votes) == VOTE_WON:
            if pre:
                self._campaign(pre=False, transfer=transfer)
            else:
                self._become_leader()
            return
        self._campaign_transfer = transfer
        self._request_votes(pre, transfer)

    def _request_votes(self, pre: bool, transfer: bool) -> None:
        """(Pre)vote requests to every voter that has not answered this campaign yet."""
        log = self.log
        li = log.last_index()
        lt = log.term(li)
        cls = PreVote if pre else Vote
        vote_term = self.term + 1 if pre else self.term
        for v in self.voters:
            if v != self.id and v not in self.votes:
                self._send(cls(self.id, v, vote_term, li, lt, transfer))

    # ======================================================================================
    # Internals: message handling
    # ======================================================================================

    def _handle_vote_request(self, m, pre: bool) -> None:
        can_vote = (
            self.vote == m.frm
            or (self.vote == NONE and self.lead == NONE)
            or (pre and m.term > self.term)
        )
        if can_vote and m.frm in self.voters and self.log.is_up_to_date(m.last_index, m.last_term):
            if pre:
                if self.role == PRE_CANDIDATE and not self._yield_pre_vote(m):
                    self._send(PreVoteResp(self.id, m.frm, self.term, reject=True))
                    return
                if self.role == FOLLOWER and self._yielded_term != self.term:
                    # Like a vote, a pre-vote grant holds our own campaign off for one
                    # election timeout (once per term, see _yield_pre_vote): a follower
                    # that vouched for a node and then timed out itself took the other
                    # followers' votes in a 5-voter cluster and split the election. The
                    # lease is still measured by election_elapsed, which goes on growing.
                    self._yielded_term = self.term
                    self.randomized_election_timeout = max(
                        self.randomized_election_timeout, self.election_elapsed + self._election_lo
                    )
                self._send(PreVoteResp(self.id, m.frm, m.term, reject=False))
            else:
                self.election_elapsed = 0
                self.vote = m.frm
                self._send(VoteResp(self.id, m.frm, m.term, reject=False))
        elif pre:
            self._send(PreVoteResp(self.id, m.frm, self.term, reject=True))
        else:
            self._send(VoteResp(self.id, m.frm, self.term, reject=True))

    def _yield_pre_vote(self, m: PreVote) -> bool:
        """Whether this pre-candidate grants a competing pre-campaign ``m`` (whose log is at
        least as up to date as ours); a grant also ends our own pre-campaign.

        Two followers of a dead leader that time out within a message delay of each other
        used to grant each other's pre-votes, both went on to campaign for the same term,
        each voted for itself and neither could win: the election waited for a second
        randomised timeout (tests/replog/test_sim_failover.py). So of two pre-campaigns
        for the same term with equal logs only the lower node id goes on (the other
        refuses it and is refused), and one that grants a pre-vote stops campaigning, so
        that it can vote for the node it has just vouched for. Refusing a pre-vote and
        giving up a pre-campaign change no term, vote or log: election safety is the
        vote's, untouched. Giving up happens once per term, so a node whose own grants
        never arrive (a one-way link) cannot keep the others from campaigning."""
        log = self.log
        li = log.last_index()
        tied = m.term == self.term + 1 and m.last_index == li and m.last_term == log.term(li)
        if tied and m.frm > self.id:
            return False
        if self._yielded_term != self.term:
            self._yielded_term = self.term
            self._become_follower(self.term, NONE)
        return True

    def _step_follower(self, m, mt) -> None:
        if mt is Append:
            self.election_elapsed = 0
            self.lead = m.frm
            self._handle_append(m)
        elif mt is Heartbeat:
            self.election_elapsed = 0
            self.lead = m.frm
            self._handle_heartbeat(m)
        elif mt is InstallSnapshot:
            self.election_elapsed = 0
            self.lead = m.frm
            self._handle_snapshot(m)
        elif mt is TimeoutNow:
            self._hup(transfer=True)
        elif mt is ReadIndexResp:
            self.read_states.append(ReadState(m.index, m.context))

    def _step_candidate(self, m, mt) -> None:
        if mt is Append:
            self._become_follower(m.term, m.frm)
            self._handle_append(m)
        elif mt is Heartbeat:
            self._become_follower(m.term, m.frm)
            self._handle_heartbeat(m)
        elif mt is InstallSnapshot:
            self._become_follower(m.term, m.frm)
            self._handle_snapshot(m)
        elif (mt is PreVoteResp and self.role == PRE_CANDIDATE) or (
            mt is VoteResp and self.role == CANDIDATE
        ):
            if m.frm not in self.votes:
                self.votes[m.frm] = not m.reject
            res = vote_result(self.voters, self.votes)
            if res == VOTE_WON:
                if self.role == PRE_CANDIDATE:
                    self._campaign(pre=False, transfer=False)
                else:
                    self._become_leader()
            elif res == VOTE_LOST:
                self._become_follower(self.term, NONE)

    def _handle_append(self, m: Append) -> None:
        log = self.log
        if m.prev_index < log.committed:
            self._send(AppendResp(self.id, m.frm, self.term, index=log.committed))
            return
        lastnewi = log.maybe_append(m.prev_index, m.prev_term, m.commit, m.entries)
        if lastnewi is not None:
            self._send(AppendResp(self.id, m.frm, self.term, index=lastnewi))
            return
        hint = min(m.prev_index, log.last_index())
        hint_index, hint_term = log.find_conflict_by_term(hint, m.prev_term)
        self._send(
            AppendResp(
                self.id,
                m.frm,
                self.term,
                index=m.prev_index,
                reject=True,
                hint_index=hint_index,
                hint_term=hint_term,
            )
        )

    def _handle_heartbeat(self, m: Heartbeat) -> None:
        log = self.log
        # commit <= the leader's view of our match, which is durable here; clamp anyway so a
        # node that lost acknowledged data (durability="memory") does not crash.
        log.commit_to(min(m.commit, log.last_index()))
        self._send(HeartbeatResp(self.id, m.frm, self.term, m.ctx))

    def _handle_snapshot(self, m: InstallSnapshot) -> None:
        if self._restore(m.snapshot):
            self._send(InstallSnapshotResp(self.id, m.frm, self.term, index=self.log.last_index()))
        else:
            self._send(InstallSnapshotResp(self.id, m.frm, self.term, index=self.log.committed))

    def _restore(self, snap: Snapshot) -> bool:
        log = self.log
        meta = snap.meta
        if meta.index <= log.committed:
            return False
        cs = meta.conf_state
        if log.match_term(meta.index, meta.term):
            # We already have the entries it covers: just learn that they are committed.
            log.commit_to(meta.index)
            return False
        log.restore(snap)
        self.voters = tuple(sorted(cs.voters))
        self.learners = tuple(sorted(cs.learners))
        return True

    def _step_leader(self, m, mt) -> None:
        pr = self.prs.get(m.frm)
        if pr is None:
            return
        if mt is AppendResp:
            pr.recent_active = True
            self._handle_append_resp(m, pr)
        elif mt is HeartbeatResp:
            pr.recent_active = True
            self._handle_heartbeat_resp(m, pr)
        elif mt is InstallSnapshotResp:
            pr.recent_active = True
            pr.maybe_update(m.index)
            if pr.state == SNAPSHOT:
                pr.become_probe()
            self._maybe_commit()
            self._send_append(m.frm, pr)
        elif mt is ReadIndex:
            pr.recent_active = True
            self._leader_read(m.context, m.frm)

    def _handle_append_resp(self, m: AppendResp, pr: Progress) -> None:
        if m.reject:
            next_probe = m.hint_index
            if m.hint_term > 0:
                next_probe = self.log.find_conflict_by_term(m.hint_index, m.hint_term)[0]
            if pr.maybe_decr_to(m.index, next_probe):
                if pr.state == REPLICATE:
                    pr.become_probe()
                self._send_append(m.frm, pr)
            return
        if not pr.maybe_update(m.index):
            if pr.state == REPLICATE:
                pr.inflights.free_le(m.index)
            return
        if pr.state == PROBE:
            pr.become_replicate()
        elif pr.state == SNAPSHOT:
            if pr.match + 1 >= self.log.first_index():
                pr.become_probe()
                pr.become_replicate()
        else:
            pr.inflights.free_le(m.index)
        self._maybe_commit()
        while self._send_append(m.frm, pr, send_if_empty=False):
            pass
        if m.frm == self.lead_transferee and pr.match == self.log.last_index():
            self._send_timeout_now(m.frm)

    def _handle_heartbeat_resp(self, m: HeartbeatResp, pr: Progress) -> None:
        pr.probe_sent = False
        if pr.state == REPLICATE:
            if pr.match < self.log.last_index():
                if pr.match == pr.hb_match:
                    # No progress since the previous heartbeat answer: an Append may have
                    # been lost. Free a slot of a full window and probe (an Append at our
                    # end makes the follower reveal a gap).
                    if pr.inflights.full():
                        pr.inflights.free_first_one()
                    self._send_append(m.frm, pr)
                else:
                    while self._send_append(m.frm, pr, send_if_empty=False):
                        pass
            pr.hb_match = pr.match
        elif pr.state == PROBE:
            self._send_append(m.frm, pr)
        if m.ctx and not pr.is_learner and self.readonly.ack(m.frm, m.ctx):
            self._check_read_rounds()

    # ======================================================================================
    # Internals: commitment, reads, proposals, membership
    # ======================================================================================

    def _maybe_commit(self) -> bool:
        log = self.log
        prs = self.prs
        me = self.id
        matches = [
            log.persisted if v == me else prs[v].match for v in self.voters if v == me or v in prs
        ]
        if not log.maybe_commit(committed_index(matches), self.term):
            return False
        ro = self.readonly
        if ro.awaiting_commit and self._committed_in_term():
            reqs = ro.awaiting_commit
            ro.awaiting_commit = []
            for ctx, frm in reqs:
                self._leader_read(ctx, frm)
        return True

    def _committed_in_term(self) -> bool:
        return self.log.zero_term(self.log.committed) == self.term

    def _leader_read(self, ctx: bytes, frm: int) -> None:
        ro = self.readonly
        if not self._committed_in_term():
            ro.awaiting_commit.append((ctx, frm))
            return
        if self._lease_mode and self._lease_valid():
            self._respond_read(self.log.committed, ctx, frm)
            return
        ro.unsent.append((ctx, frm))

    def _lease_valid(self) -> bool:
        if self._lease_revoked or self.lead_transferee != NONE:
            return False
        start = self.readonly.lease_start(self.voters, self.id, self._ticks)
        return start is not None and self._ticks - start < self._lease_ticks

    def _check_read_rounds(self) -> None:
        for index, reqs in self.readonly.confirmed(self.voters, self.id):
            for ctx, frm in reqs:
                self._respond_read(index, ctx, frm)

    def _respond_read(self, index: int, ctx: bytes, frm: int) -> None:
        if frm == self.id:
            self.read_states.append(ReadState(index, ctx))
        else:
            self._send(ReadIndexResp(self.id, frm, self.term, index, ctx))
            # The follower serves the read once it has applied ``index``: tell it the commit
            # index now rather than at the next heartbeat.
            pr = self.prs.get(frm)
            if pr is not None:
                self._send_append(frm, pr)

    def _check_can_propose(self) -> None:
        if self.role != LEADER:
            raise NotLeader(self.lead or None)
        if self.lead_transferee != NONE:
            raise ProposalDropped(f"leadership transfer to {self.lead_transferee} in progress")

    def _charge_uncommitted(self, size: int) -> None:
        cap = self.cfg.max_uncommitted_bytes
        if cap and self.uncommitted_size > 0 and self.uncommitted_size + size > cap:
            raise ProposalDropped(
                f"too much uncommitted data ({self.uncommitted_size} bytes, "
                f"limit {cap}); retry later"
            )
        self.uncommitted_size += size

    def _validate_conf_change(self, cc: ConfChange) -> None:
        n = cc.node_id
        t = cc.type
        if n <= 0:
            raise ConfChangeError(f"invalid node id {n}")
        if t == ConfChangeType.ADD_VOTER:
            if n in self.voters:
                raise ConfChangeError(f"node {n} is already a voter")
        elif t == ConfChangeType.ADD_LEARNER:
            if n in self.voters:
                raise ConfChangeError(f"node {n} is a voter; demoting voters is not supported")
            if n in self.learners:
                raise ConfChangeError(f"node {n} is already a learner")
        elif t == ConfChangeType.REMOVE_NODE:
            if n not in self.voters and n not in self.learners:
                raise ConfChangeError(f"node {n} is not a member")
            if self.voters == (n,):
                raise ConfChangeError(f"cannot remove {n}: it is the last voter")
        elif t == ConfChangeType.PROMOTE_LEARNER:
            if n not in self.learners:
                raise ConfChangeError(f"node {n} is not a learner")
        else:
            raise ConfChangeError(f"unknown configuration change type {t}")

    def _apply_conf_change_to_sets(self, cc: ConfChange) -> None:
        cs = next_conf_state(ConfState(self.voters, self.learners), cc)
        self.voters, self.learners = cs.voters, cs.learners

    def _apply_conf_change(self, cc: ConfChange) -> None:
        self._apply_conf_change_to_sets(cc)
        if self.role == LEADER:
            members = (*self.voters, *self.learners)
            last = self.log.last_index()
            cfg = self.cfg
            for n in members:
                if n not in self.prs:
                    self.prs[n] = Progress(last + 1, cfg.max_inflight_msgs, cfg.max_inflight_bytes)
            for n in [n for n in self.prs if n not in members]:
                del self.prs[n]
            for n, pr in self.prs.items():
                pr.is_learner = n in self.learners
            self._peer_ids = tuple(sorted(n for n in self.prs if n != self.id))
            if self.id not in self.voters:
                self._step_down_removed()
                return
            if self.lead_transferee != NONE and self.lead_transferee not in self.voters:
                self.lead_transferee = NONE
            self._need_flush = True
            self._maybe_commit()
            self._check_read_rounds()
        elif self.role != FOLLOWER and self.id not in self.voters:
            self._become_follower(self.term, NONE)

    def _step_down_removed(self) -> None:
        """This leader applied its own removal: tell followers the commit index, hand over
        to the most up-to-date voter, and step down."""
        self._commit_dirty = True
        self._flush()
        last = self.log.last_index()
        best, best_match = NONE, -1
        for v in self.voters:
            pr = self.prs.get(v)
            if pr is not None and pr.match > best_match:
                best, best_match = v, pr.match
        if best != NONE and best_match == last:
            self._send_timeout_now(best)
        self._become_follower(self.term, NONE)
