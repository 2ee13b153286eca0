"""Every exception of the replicated log, and their wire codes.

All derive from :class:`ReplogError`. Each class has a ``code``; the client protocol carries
errors as ``(code, message)`` (``protocol.Response.kind``) and :data:`ERROR_CODES` maps a code
back to its class, so a refusal on a replica raises the same class in the client (same
scheme as :mod:`kvmesh.transfer.errors`). :data:`RETRYABLE` lists the codes after which a
client may try another replica (or the same one later) without changing the outcome.

The modules that raise these errors re-export them under their historical names
(``types.NotLeader``, ``node.ProposalTimeout``, ``wal.WalFatalError``...).
"""

from __future__ import annotations

from kvmesh.errors import ErrorTable

__all__ = [
    "ERROR_CODES",
    "RETRYABLE",
    "BadRequest",
    "ClusterUnavailable",
    "CommandError",
    "ConfChangeError",
    "FrameError",
    "LeaderTransferError",
    "LogCompacted",
    "LogUnavailable",
    "NodeStopped",
    "NotLeader",
    "NotLeaderError",
    "Overloaded",
    "ProposalDropped",
    "ProposalLost",
    "ProposalTimeout",
    "ProposalTooLarge",
    "ReadTimeout",
    "ReadyContractError",
    "ReplogError",
    "ResultEvicted",
    "SessionDenied",
    "SessionExpiredError",
    "SnapshotCorruptionError",
    "SnapshotTemporarilyUnavailable",
    "StorageCorruptionError",
    "StorageError",
    "StorageLockedError",
    "Unauthorized",
    "WalCorruptionError",
    "WalError",
    "WalFatalError",
    "error_from_code",
]


class ReplogError(Exception):
    """Base of all replicated-log errors."""

    code = "error"


# -- answers to client requests ------------------------------------------------------------


class NotLeader(ReplogError):
    """This node cannot serve the request; ``leader_hint`` is the leader it knows of, or
    None."""

    code = "not_leader"

    def __init__(self, leader_hint: int | None = None, message: str | None = None) -> None:
        self.leader_hint = leader_hint
        super().__init__(message or f"not the leader (leader hint: {leader_hint})")


class NotLeaderError(NotLeader):
    """This replica is not the leader. ``leader_id`` (or None) and ``leader_addr`` (the
    address clients should use, or None) tell where to go."""

    def __init__(
        self,
        leader_id: int | None = None,
        leader_addr: str | None = None,
        message: str | None = None,
    ) -> None:
        self.leader_id = leader_id
        self.leader_addr = leader_addr
        where = f"leader is {leader_id} at {leader_addr}" if leader_id else "no leader known"
        super().__init__(leader_id, message or f"not the leader ({where})")

    @classmethod
    def from_wire(cls, message: str) -> NotLeaderError:
        # The wire carries the leader separately (protocol.Response), not in the message.
        return cls(None, None, message)


class ProposalDropped(ReplogError):
    """The leader refused a proposal for a transient reason; retrying later (on the same or
    another node) is safe."""

    code = "dropped"


class ProposalTooLarge(ProposalDropped):
    """The entry would exceed ``max_size_per_msg``; retrying will not help."""

    code = "too_large"


class ProposalLost(ProposalDropped):
    """A different entry was committed at the proposal's index: it was definitely not
    applied (retry it, ideally with the same session sequence number)."""

    code = "lost"


class ProposalTimeout(ReplogError, TimeoutError):
    """No result in time; the command may or may not be applied. Retry with the same
    ``(client_id, seq)`` to get its result exactly once."""

    code = "timeout"


class ReadTimeout(ReplogError, TimeoutError):
    """A read index could not be confirmed in time (no quorum, leader change)."""

    code = "read_timeout"


class NodeStopped(ReplogError):
    """The node stopped (shutdown or a fatal storage error) before answering."""

    code = "stopped"


class SessionExpiredError(ReplogError):
    """The client session is unknown (expired or never registered) or the sequence number
    is below its acknowledged floor: the command was *not* applied now, and whether an
    earlier attempt was applied cannot be known any more."""

    code = "session"


class ResultEvicted(SessionExpiredError):
    """The command's seq is at or below one whose result the session table evicted
    unacknowledged (the per-session or total bound on cached results): it was *not*
    applied now; an earlier attempt may have been applied once. Never retry it blindly."""

    code = "result_evicted"


class SessionDenied(ReplogError):
    """The command names a session whose token it does not carry (another client's
    session): refused, nothing applied, the session untouched."""

    code = "session_denied"


class CommandError(ReplogError):
    """The state machine raised while applying the command (deterministically, on every
    replica); the message is the exception's."""

    code = "command"


class BadRequest(ReplogError, ValueError):
    """A malformed or unacceptable request (undecodable, a field out of range, a result
    that cannot be encoded)."""

    code = "bad_request"


class Unauthorized(ReplogError):
    """The request needs an authenticated connection (admin requests), or the peer failed
    authentication."""

    code = "auth"


class Overloaded(ReplogError):
    """The server refused work to protect itself (too many requests in flight on this
    connection); retry later."""

    code = "overloaded"


class ClusterUnavailable(ReplogError, TimeoutError):
    """No replica answered usefully before the deadline (client side)."""

    code = "unavailable"


# -- core ----------------------------------------------------------------------------------


class ConfChangeError(ReplogError):
    """A membership change is invalid for the current configuration."""

    code = "conf_change"


class LeaderTransferError(ReplogError):
    """A leadership transfer target is invalid (not a voter of the current configuration)."""

    code = "leader_transfer"


class ReadyContractError(ReplogError):
    """The Ready/advance protocol was misused (e.g. ``ready()`` before ``advance()``)."""

    code = "ready_contract"


# -- storage -------------------------------------------------------------------------------


class StorageError(ReplogError):
    """Base of storage errors the core understands."""

    code = "storage"


class LogCompacted(StorageError):
    """The requested index was compacted into a snapshot."""

    code = "log_compacted"


class LogUnavailable(StorageError):
    """The requested index is beyond the last index."""

    code = "log_unavailable"


class SnapshotTemporarilyUnavailable(StorageError):
    """The storage is building a snapshot; ask again later."""

    code = "snapshot_unavailable"


class StorageCorruptionError(StorageError):
    """The data directory is inconsistent or damaged; the node must not start on it."""

    code = "storage_corrupt"


class StorageLockedError(StorageError):
    """Another process holds this data directory."""

    code = "storage_locked"


class WalError(ReplogError):
    """Base class of WAL errors."""

    code = "wal"


class WalCorruptionError(WalError):
    """A record that was durable is unreadable (bit flip, lost sector): fail stop."""

    code = "wal_corrupt"


class WalFatalError(WalError):
    """A write or fsync failed: the WAL can no longer promise durability."""

    code = "wal_fatal"


class SnapshotCorruptionError(ReplogError):
    """A snapshot file or blob failed verification."""

    code = "snapshot_corrupt"


# -- transport -----------------------------------------------------------------------------


class FrameError(ReplogError):
    """A peer sent a malformed frame; the connection is closed."""

    code = "frame"


_TABLE: ErrorTable[ReplogError] = ErrorTable(
    ReplogError,
    (
        ReplogError,
        NotLeaderError,  # NotLeader shares its code; the richer class is rebuilt
        ProposalDropped,
        ProposalTooLarge,
        ProposalLost,
        ProposalTimeout,
        ReadTimeout,
        NodeStopped,
        SessionExpiredError,
        ResultEvicted,
        SessionDenied,
        CommandError,
        BadRequest,
        Unauthorized,
        Overloaded,
        ClusterUnavailable,
        ConfChangeError,
        LeaderTransferError,
        ReadyContractError,
        StorageError,
        LogCompacted,
        LogUnavailable,
        SnapshotTemporarilyUnavailable,
        StorageCorruptionError,
        StorageLockedError,
        WalError,
        WalCorruptionError,
        WalFatalError,
        SnapshotCorruptionError,
        FrameError,
    ),
)
ERROR_CODES: dict[str, type[ReplogError]] = _TABLE.by_code  # type: ignore[assignment]

RETRYABLE: frozenset[str] = frozenset(
    c.code
    for c in (ProposalTimeout, ReadTimeout, ProposalDropped, ProposalLost, NodeStopped, Overloaded)
)
"""Codes after which the same request may go to another replica (or later) safely."""


def error_from_code(code: str, message: str) -> ReplogError:
    """Rebuild a local exception from a wire ``(code, message)`` pair (unknown codes give
    a plain :class:`ReplogError`)."""
    return _TABLE.error_for(code, message)
