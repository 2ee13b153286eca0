"""Wire, state and interface types of the replicated log: the contract between the sans-I/O
Raft core (``core/``), storages (``storage/memory.py``, ``storage/disk.py``) and drivers
(``node.py``, the simulator in ``sim/``).

Conventions
-----------
* Node ids are positive ints; ``NONE`` (0) means "no node" (no vote, no known leader).
* Log indices start at 1; index 0 is the empty log's sentinel (term 0). Ranges are half-open
  ``[lo, hi)`` like etcd-raft's ``Storage.Entries``.
* Entry payloads are opaque ``bytes``: the core never decodes application commands. The only
  payloads the core reads are ``CONF_CHANGE`` entries (an encoded :class:`ConfChange`).
* A new cluster's log starts with :func:`bootstrap_entries` (one ``CONF_CHANGE`` entry per
  initial member, term 1, committed): every founding replica persists the same prefix, and a
  replica added later learns the whole membership history from the log (or a snapshot).
* Messages are ``array_like`` msgspec Structs in one tagged union (int tags), encoded as
  msgpack with :func:`encode_message` / :func:`decode_message`. Heartbeat ``ctx`` is a
  leader-chosen round number used to confirm leadership for read-index and lease reads.

The Ready contract (see :class:`Ready`) is etcd-raft's, with raft-rs's split of messages:
persist ``snapshot_to_install``, ``entries_to_append`` and ``hard_state`` (that order, or
atomically; one fsync when ``must_sync``); ``send_now`` may go out at any time (even before
the fsync: it only holds messages whose content is already durable or needs no durability,
such as a leader's appends, thesis §10.2.1); ``send_after_persist`` only once the fsync is done;
restore the state machine from ``snapshot_to_install`` and apply ``committed_entries`` in
order; then call ``advance(ready)``. ``committed_entries`` never contains an entry that is not
already durable locally and on a quorum (etcd issue #14370), so applying may overlap with
persisting.

Stability: this module is the contract other modules build on. Changes after the first
commit are backward-compatible additions only; they are listed here.

Change log
----------
* v1: initial contract.
* v1.1: ``LeaderTransferError``; ``RaftConfig.lease_ticks`` subtracts one tick of
  granularity (see its docstring).
* v1.2: the error classes live in ``errors.py`` (with wire codes) and are re-exported here.
* v1.3: :class:`StateMachine` declares the whole contract (``snapshot_chunks``, ``query``,
  ``result_type``, used before but undeclared); :class:`StateMachineBase` gives defaults.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import msgspec

from .errors import (
    ConfChangeError,
    LeaderTransferError,
    LogCompacted,
    LogUnavailable,
    NotLeader,
    ProposalDropped,
    ProposalTooLarge,
    ReadyContractError,
    ReplogError,
    SnapshotTemporarilyUnavailable,
    StorageError,
)

__all__ = [
    "NONE",
    "ENTRY_OVERHEAD",
    "limit_size",
    "EntryKind",
    "Entry",
    "HardState",
    "ConfState",
    "ConfChangeType",
    "ConfChange",
    "SnapshotMeta",
    "Snapshot",
    "Role",
    "SoftState",
    "ReadState",
    "ReadOnlyOption",
    "RaftConfig",
    "Vote",
    "VoteResp",
    "PreVote",
    "PreVoteResp",
    "Append",
    "AppendResp",
    "Heartbeat",
    "HeartbeatResp",
    "InstallSnapshot",
    "InstallSnapshotResp",
    "TimeoutNow",
    "ReadIndex",
    "ReadIndexResp",
    "Message",
    "MESSAGE_TYPES",
    "encode_message",
    "decode_message",
    "encode_conf_change",
    "decode_conf_change",
    "entry_size",
    "bootstrap_entries",
    "Ready",
    "ProgressState",
    "ProgressStatus",
    "Status",
    "LogStorage",
    "StateMachine",
    "StateMachineBase",
    "snapshot_chunks_of",
    "ReplogError",
    "NotLeader",
    "ProposalDropped",
    "ProposalTooLarge",
    "ConfChangeError",
    "LeaderTransferError",
    "ReadyContractError",
    "StorageError",
    "LogCompacted",
    "LogUnavailable",
    "SnapshotTemporarilyUnavailable",
]

NONE = 0
"""The "no node" id: no vote cast, no leader known."""

ENTRY_OVERHEAD = 16
"""Bytes charged per entry on top of its payload for every size limit (message size,
inflight bytes, uncommitted bytes, committed bytes per Ready)."""


# --------------------------------------------------------------------------------------
# Log and persistent state
# --------------------------------------------------------------------------------------


class EntryKind(enum.IntEnum):
    """Kinds of log entries. An empty ``NORMAL`` entry is a new leader's no-op."""

    NORMAL = 0
    CONF_CHANGE = 1


class Entry(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One log entry. ``kind`` is an :class:`EntryKind` value (stored as a plain int)."""

    term: int
    index: int
    kind: int = EntryKind.NORMAL
    data: bytes = b""


def entry_size(e: Entry) -> int:
    """Size charged for ``e`` by all byte limits."""
    return len(e.data) + ENTRY_OVERHEAD


def limit_size(ents: list[Entry], max_bytes: int | None) -> list[Entry]:
    """Longest prefix of ``ents`` whose ``entry_size`` total stays within ``max_bytes``,
    but at least one entry."""
    if max_bytes is None or len(ents) <= 1:
        return ents
    total = 0
    for i, e in enumerate(ents):
        total += len(e.data) + ENTRY_OVERHEAD
        if total > max_bytes and i > 0:
            return ents[:i]
    return ents


class HardState(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What must be durable before a node speaks in a term: current term, the vote cast in
    it, and the commit index (the commit index is a hint; it may be relearned)."""

    term: int = 0
    vote: int = NONE
    commit: int = 0


class ConfState(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A membership configuration. Tuples are kept sorted so that iteration is
    deterministic."""

    voters: tuple[int, ...] = ()
    learners: tuple[int, ...] = ()


class ConfChangeType(enum.IntEnum):
    """Single-server membership changes.

    ``ADD_VOTER`` on an existing learner promotes it (like etcd's AddNode);
    ``PROMOTE_LEARNER`` does the same but is refused when the node is not a learner.
    """

    ADD_VOTER = 0
    ADD_LEARNER = 1
    REMOVE_NODE = 2
    PROMOTE_LEARNER = 3


class ConfChange(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A membership change, carried in a ``CONF_CHANGE`` entry's ``data``.

    ``context`` is opaque to the core; drivers use it to carry the new member's address.
    """

    type: int
    node_id: int
    context: bytes = b""


class SnapshotMeta(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Index and term of the last entry a snapshot covers, and the configuration then."""

    index: int = 0
    term: int = 0
    conf_state: ConfState = ConfState()


class Snapshot(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A state-machine image (``data`` from :meth:`StateMachine.snapshot`) plus metadata."""

    meta: SnapshotMeta = SnapshotMeta()
    data: bytes = b""


# --------------------------------------------------------------------------------------
# Volatile state reported to the driver
# --------------------------------------------------------------------------------------


class Role(enum.IntEnum):
    FOLLOWER = 0
    PRE_CANDIDATE = 1
    CANDIDATE = 2
    LEADER = 3


class SoftState(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Volatile state that the driver may want to react to (leader changes)."""

    leader: int = NONE
    role: int = Role.FOLLOWER


class ReadState(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Answer to ``read_index(ctx)``: serve the read once ``applied >= index``."""

    index: int
    context: bytes


class ReadOnlyOption(str, enum.Enum):
    """How linearizable reads are confirmed.

    ``SAFE``: every read batch waits for a heartbeat round acknowledged by a quorum.
    ``LEASE_BASED``: the leader answers at once while it holds a lease (a quorum acknowledged
    a heartbeat round sent less than ``election_tick * (1 - lease_drift_bound)`` ticks ago);
    otherwise it falls back to a SAFE round. Requires ``check_quorum``; safe only while
    clocks drift by less than ``lease_drift_bound``.
    """

    SAFE = "safe"
    LEASE_BASED = "lease_based"


class RaftConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Tunables of the Raft core (time is counted in ticks; the driver decides how long a
    tick is, e.g. 100 ms).

    * ``election_tick``: minimum election timeout; followers campaign after a randomised
      timeout in ``[election_tick, max_election_tick)``; a leader's check-quorum window.
    * ``max_election_tick``: exclusive upper bound of the randomised timeout; 0 means
      ``2 * election_tick``.
    * ``heartbeat_tick``: leader heartbeat interval.
    * ``pre_vote`` / ``check_quorum``: thesis §9.6 and §6.2.
    * ``read_only_option``, ``lease_drift_bound``: see :class:`ReadOnlyOption`.
    * ``max_size_per_msg``: byte cap (payloads + ``ENTRY_OVERHEAD`` each) of entries in one
      Append. Proposals whose entry is larger are refused (:class:`ProposalTooLarge`).
    * ``max_inflight_msgs`` / ``max_inflight_bytes``: pipelining window per follower
      (0 bytes = unlimited).
    * ``max_uncommitted_bytes``: proposals fail fast (:class:`ProposalDropped`) once the
      leader holds this many uncommitted bytes (0 = unlimited).
    * ``max_committed_size_per_ready``: cap on ``committed_entries`` bytes per Ready (at least
      one entry is always handed out).
    * ``snapshot_timeout_tick``: a follower stuck in snapshot state without an answer is
      probed again after this many ticks (0 = ``4 * election_tick``).
    """

    election_tick: int = 10
    heartbeat_tick: int = 1
    max_election_tick: int = 0
    pre_vote: bool = True
    check_quorum: bool = True
    read_only_option: ReadOnlyOption = ReadOnlyOption.SAFE
    lease_drift_bound: float = 0.1
    max_size_per_msg: int = 1 << 20
    max_inflight_msgs: int = 256
    max_inflight_bytes: int = 0
    max_uncommitted_bytes: int = 1 << 26
    max_committed_size_per_ready: int = 1 << 26
    snapshot_timeout_tick: int = 0

    def __post_init__(self) -> None:
        if self.heartbeat_tick <= 0:
            raise ValueError(f"heartbeat_tick must be > 0, got {self.heartbeat_tick}")
        if self.election_tick <= self.heartbeat_tick:
            raise ValueError(
                f"election_tick ({self.election_tick}) must be greater than heartbeat_tick "
                f"({self.heartbeat_tick})"
            )
        if self.max_election_tick and self.max_election_tick <= self.election_tick:
            raise ValueError(
                f"max_election_tick ({self.max_election_tick}) must be greater than "
                f"election_tick ({self.election_tick})"
            )
        if self.read_only_option is ReadOnlyOption.LEASE_BASED and not self.check_quorum:
            raise ValueError("read_only_option=LEASE_BASED requires check_quorum=True")
        if not 0.0 <= self.lease_drift_bound < 1.0:
            raise ValueError(f"lease_drift_bound must be in [0, 1), got {self.lease_drift_bound}")
        if self.max_size_per_msg <= ENTRY_OVERHEAD:
            raise ValueError(f"max_size_per_msg too small: {self.max_size_per_msg}")
        if self.max_inflight_msgs <= 0:
            raise ValueError(f"max_inflight_msgs must be > 0, got {self.max_inflight_msgs}")
        for name in ("max_inflight_bytes", "max_uncommitted_bytes", "snapshot_timeout_tick"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.max_committed_size_per_ready <= 0:
            raise ValueError("max_committed_size_per_ready must be > 0")

    @property
    def election_range(self) -> tuple[int, int]:
        """Half-open range of the randomised election timeout, in ticks."""
        return self.election_tick, self.max_election_tick or 2 * self.election_tick

    @property
    def lease_ticks(self) -> int:
        """Lease length in ticks, measured from when the confirming round was sent:
        ``floor(election_tick * (1 - lease_drift_bound)) - 1``. The extra tick pays for tick
        granularity: a follower refuses votes for more than ``election_tick - 1`` of its own
        tick periods after hearing from the leader, while a read at tick difference d may
        happen up to d + 1 leader periods after the round was sent. Leases are then safe as
        long as the leader's clock is slower than any follower's by less than the bound."""
        return max(0, math.floor(self.election_tick * (1.0 - self.lease_drift_bound) + 1e-9) - 1)


# --------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------


class _Msg(msgspec.Struct, array_like=True, frozen=True, gc=False):
    frm: int
    to: int
    term: int


class Vote(_Msg, tag=1):
    """RequestVote. ``transfer`` marks a campaign started by TimeoutNow (leader transfer):
    receivers then grant even while they believe a leader is alive."""

    last_index: int
    last_term: int
    transfer: bool = False


class VoteResp(_Msg, tag=2):
    reject: bool


class PreVote(_Msg, tag=3):
    """Pre-vote (thesis §9.6): ``term`` is the term the sender would campaign in; nobody's
    term changes."""

    last_index: int
    last_term: int
    transfer: bool = False


class PreVoteResp(_Msg, tag=4):
    reject: bool


class Append(_Msg, tag=5):
    """AppendEntries: ``entries`` follow ``(prev_index, prev_term)``; ``commit`` is the
    leader's commit index."""

    prev_index: int
    prev_term: int
    commit: int
    entries: list[Entry] = []


class AppendResp(_Msg, tag=6):
    """Answer to Append/Heartbeat.

    Success: ``index`` is the highest index known to match the leader's log (durable).
    Reject: ``index`` is the rejected ``prev_index``; ``(hint_index, hint_term)`` is the
    follower's last entry at or below it with a term no greater than the leader's
    ``prev_term`` (fast backtracking).
    """

    index: int
    reject: bool = False
    hint_index: int = 0
    hint_term: int = 0


class Heartbeat(_Msg, tag=7):
    """``commit`` is ``min(follower's match, leader's commit)``; ``ctx`` is the leader's
    heartbeat round number (read-index / lease confirmation), echoed in the response."""

    commit: int
    ctx: int = 0


class HeartbeatResp(_Msg, tag=8):
    ctx: int = 0


class InstallSnapshot(_Msg, tag=9):
    snapshot: Snapshot


class InstallSnapshotResp(_Msg, tag=10):
    """Sent after the snapshot (or the fact that it was not needed) is durable: ``index`` is
    the highest index the follower now knows to match the leader's log."""

    index: int


class TimeoutNow(_Msg, tag=11):
    """Leader transfer: the receiver campaigns at once (no pre-vote)."""


class ReadIndex(_Msg, tag=12):
    """Follower read: ask the leader for a read index on behalf of ``context``."""

    context: bytes


class ReadIndexResp(_Msg, tag=13):
    index: int
    context: bytes


Message = (
    Vote
    | VoteResp
    | PreVote
    | PreVoteResp
    | Append
    | AppendResp
    | Heartbeat
    | HeartbeatResp
    | InstallSnapshot
    | InstallSnapshotResp
    | TimeoutNow
    | ReadIndex
    | ReadIndexResp
)
MESSAGE_TYPES: tuple[type, ...] = Message.__args__  # type: ignore[attr-defined]

_encoder = msgspec.msgpack.Encoder()
_msg_decoder = msgspec.msgpack.Decoder(Message)
_cc_decoder = msgspec.msgpack.Decoder(ConfChange)


def encode_message(msg: Message) -> bytes:
    """msgpack bytes of one message (tag first)."""
    return _encoder.encode(msg)


def decode_message(buf: bytes | bytearray | memoryview) -> Message:
    """Inverse of :func:`encode_message`; raises ``msgspec.ValidationError`` /
    ``msgspec.DecodeError`` on malformed input."""
    return _msg_decoder.decode(buf)


def encode_conf_change(cc: ConfChange) -> bytes:
    return _encoder.encode(cc)


def decode_conf_change(buf: bytes) -> ConfChange:
    return _cc_decoder.decode(buf)


def bootstrap_entries(
    voters: tuple[int, ...] | list[int], learners: tuple[int, ...] | list[int] = ()
) -> tuple[list[Entry], HardState]:
    """The identical log prefix every founding replica persists before its first start:
    one ``CONF_CHANGE`` entry per member at term 1, all committed."""
    voters = sorted(voters)
    learners = sorted(learners)
    if not voters:
        raise ValueError("a cluster needs at least one voter")
    if set(voters) & set(learners) or any(n <= 0 for n in [*voters, *learners]):
        raise ValueError(f"invalid bootstrap membership voters={voters} learners={learners}")
    changes = [ConfChange(int(ConfChangeType.ADD_VOTER), n) for n in voters]
    changes += [ConfChange(int(ConfChangeType.ADD_LEARNER), n) for n in learners]
    entries = [
        Entry(term=1, index=i, kind=int(EntryKind.CONF_CHANGE), data=encode_conf_change(cc))
        for i, cc in enumerate(changes, start=1)
    ]
    return entries, HardState(term=1, vote=NONE, commit=len(entries))


# --------------------------------------------------------------------------------------
# Ready and status
# --------------------------------------------------------------------------------------


class Ready(msgspec.Struct, kw_only=True):
    """One batch of work from the core (see the module docstring for the processing order).

    * ``hard_state``: persist if not None.
    * ``entries_to_append``: persist; an entry at index i replaces any persisted entries at i
      or later.
    * ``snapshot_to_install``: persist it into storage (discarding the log it covers) and
      restore the state machine from it before applying ``committed_entries``.
    * ``send_now`` / ``send_after_persist``: outgoing messages.
    * ``committed_entries``: apply in order (``CONF_CHANGE`` entries are applied by the core
      itself on ``advance``; drivers look at them only to learn new peers' addresses).
    * ``read_states``: answered read-index requests.
    * ``soft_state``: new leader/role, if it changed.
    * ``must_sync``: whether persisting needs an fsync (entries, or term/vote changed).
    """

    hard_state: HardState | None = None
    entries_to_append: list[Entry] = []
    snapshot_to_install: Snapshot | None = None
    send_now: list[Any] = []
    send_after_persist: list[Any] = []
    committed_entries: list[Entry] = []
    read_states: list[ReadState] = []
    soft_state: SoftState | None = None
    must_sync: bool = False


class ProgressState(enum.IntEnum):
    PROBE = 0
    REPLICATE = 1
    SNAPSHOT = 2


class ProgressStatus(msgspec.Struct, frozen=True):
    """The leader's view of one peer's log."""

    match: int
    next: int
    state: int
    is_learner: bool
    recent_active: bool
    inflight: int
    pending_snapshot: int = 0


class Status(msgspec.Struct, frozen=True):
    """Snapshot of a node's state for monitoring and tests."""

    id: int
    term: int
    vote: int
    commit: int
    applied: int
    role: int
    leader: int
    first_index: int
    last_index: int
    persisted_index: int
    conf_state: ConfState
    lead_transferee: int = NONE
    progress: dict[int, ProgressStatus] = {}


# --------------------------------------------------------------------------------------
# Plug-in protocols
# --------------------------------------------------------------------------------------


@runtime_checkable
class LogStorage(Protocol):
    """What the core reads from the durable log (the driver does all writes).

    ``term(i)`` is defined for ``first_index() - 1 <= i <= last_index()`` (the entry at
    ``first_index() - 1`` is the last one covered by the snapshot); below that it raises
    :class:`LogCompacted`, above :class:`LogUnavailable`. ``entries(lo, hi, max_bytes)``
    returns entries ``[lo, hi)``, stopping before the byte total (``entry_size``) would exceed
    ``max_bytes`` but always returning at least one entry when ``lo < hi``; ``None`` means no
    limit. ``snapshot()`` returns the latest snapshot or raises
    :class:`SnapshotTemporarilyUnavailable`.
    """

    def initial_state(self) -> tuple[HardState, ConfState]: ...

    def term(self, index: int) -> int: ...

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]: ...

    def first_index(self) -> int: ...

    def last_index(self) -> int: ...

    def snapshot(self) -> Snapshot: ...


@runtime_checkable
class StateMachine(Protocol):
    """The application's deterministic state machine: the whole contract the replicated log
    (driver, session layer, replica server, client) relies on.

    * ``apply(index, data)``: apply one committed command; must not read clocks, randomness
      or the environment; the result must be msgpack-encodable (it is cached for duplicate
      commands and sent to clients).
    * ``snapshot()`` / ``restore(data)``: the whole state as bytes and back. ``data`` is
      any bytes-like buffer (``bytes``, a ``bytearray`` read from a file, a ``memoryview``
      of a larger image): an image of a gigabyte is not copied to make it ``bytes``.
    * ``snapshot_chunks()``: the same image as an iterator of byte strings. The image must be
      captured when the method is called (e.g. a shallow copy) and only *encoded* lazily:
      the driver calls it at one applied index and pulls a chunk per event-loop iteration
      while applying goes on (``b"".join(chunks)`` must equal ``snapshot()``).
    * ``query(data)``: a read-only request, answered from the local state after a
      linearizable read-index barrier (the replica server's read path); must not modify
      the state.
    * ``result_type``: the msgspec type of ``apply``'s results (``Any`` if untyped): cached
      results of duplicates and client-side results are decoded with it.

    :class:`StateMachineBase` supplies the last three for machines that do not need them.
    """

    result_type: Any

    def apply(self, index: int, data: bytes) -> Any: ...

    def snapshot(self) -> bytes: ...

    def restore(self, data: bytes) -> None: ...

    def snapshot_chunks(self) -> Iterator[bytes]: ...

    def query(self, data: bytes) -> Any: ...


class StateMachineBase:
    """Defaults for :class:`StateMachine`'s optional parts: untyped results, a snapshot in
    one chunk, no queries."""

    result_type: Any = Any

    def snapshot(self) -> bytes:  # pragma: no cover - subclasses implement it
        raise NotImplementedError

    def snapshot_chunks(self) -> Iterator[bytes]:
        return iter((self.snapshot(),))

    def query(self, data: bytes) -> Any:
        raise NotImplementedError(f"{type(self).__name__} serves no queries")


def snapshot_chunks_of(sm: Any) -> Iterator[bytes]:
    """``sm.snapshot_chunks()``, or ``sm.snapshot()`` in one chunk for a machine that only
    implements the minimal apply/snapshot/restore part of the contract."""
    fn = getattr(sm, "snapshot_chunks", None)
    return fn() if fn is not None else iter((sm.snapshot(),))
