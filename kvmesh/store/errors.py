"""The store's error tree and wire codes.

Every per-key result on the wire is an ``int``: ``0`` (OK) or a negative code from
:class:`Code`. Codes equal Mooncake Store's ``ErrorCode`` values (``mooncake-store/include/
types.h``) wherever Mooncake has the same condition, so the Mooncake-compatible surface can
return them unchanged; conditions Mooncake lacks use the ``-2000`` range.

Single-key calls raise the class for the code (:func:`error_for`); batch calls return the codes.
Every class derives from :class:`StoreError`; input errors also derive from ``ValueError`` /
``LookupError`` so generic handlers work, like ``kvmesh.transfer.errors``.
"""

from __future__ import annotations

import enum

from kvmesh.errors import ErrorTable

__all__ = [
    "ERROR_CLASSES",
    "AuthFailed",
    "BufferOverflow",
    "Code",
    "InternalError",
    "InvalidKey",
    "InvalidParams",
    "InvalidRead",
    "InvalidWrite",
    "LeaseExpired",
    "NoSpace",
    "NodeNotFound",
    "NotEvictable",
    "NotRegistered",
    "ObjectExists",
    "ObjectHasLease",
    "ObjectNotFound",
    "ReplicaGone",
    "ReplicaNotReady",
    "SegmentExists",
    "SegmentNotFound",
    "SessionExpired",
    "StoreError",
    "StoreTimeout",
    "StoreUnavailable",
    "TransferFailed",
    "code_name",
    "error_for",
    "raise_for",
]


class Code(enum.IntEnum):
    """Wire codes. Values in the Mooncake range are Mooncake's ``ErrorCode``."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10  # a caller's buffer is too small for the object
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    CLIENT_NOT_FOUND = -103  # unknown storage node id
    NO_AVAILABLE_HANDLE = -200  # no space for the object (after eviction)
    INVALID_KEY = -400
    INVALID_PARAMS = -600
    INVALID_WRITE = -700  # put_end/put_revoke of a put that is not (or no longer) this one
    INVALID_READ = -701
    REPLICA_IS_NOT_READY = -703  # the key has a put in flight (PROCESSING)
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    REPLICA_IS_GONE = -712  # the copy's node died or was unmounted mid-read
    TRANSFER_FAIL = -800
    RPC_FAIL = -900  # master or node unreachable after bounded retries
    # kvmesh-only conditions
    NOT_EVICTABLE = -2001  # eviction re-check in apply: pinned, PROCESSING or re-put
    NOT_REGISTERED = -2002  # a client buffer that was never registered
    TIMEOUT = -2003
    AUTH_FAILED = -2004
    SESSION_EXPIRED = -2005  # the master forgot the client's session: not applied now


class StoreError(Exception):
    """Base of every kvmesh.store error; ``code`` is its wire code."""

    code: int = Code.INTERNAL_ERROR

    def __init__(self, message: str = "", code: int | None = None) -> None:
        if code is not None:
            self.code = code
        super().__init__(message or code_name(self.code))


class InternalError(StoreError):
    code = Code.INTERNAL_ERROR


class BufferOverflow(StoreError, ValueError):
    """A destination buffer is smaller than the object."""

    code = Code.BUFFER_OVERFLOW


class SegmentNotFound(StoreError, LookupError):
    code = Code.SEGMENT_NOT_FOUND


class SegmentExists(StoreError, ValueError):
    code = Code.SEGMENT_ALREADY_EXISTS


class NodeNotFound(StoreError, LookupError):
    code = Code.CLIENT_NOT_FOUND


class NoSpace(StoreError):
    """No segment has room for the object, even after eviction."""

    code = Code.NO_AVAILABLE_HANDLE


class InvalidKey(StoreError, ValueError):
    """Empty, non-UTF-8, NUL-containing or over-long key (``types.MAX_KEY_BYTES``)."""

    code = Code.INVALID_KEY


class InvalidParams(StoreError, ValueError):
    code = Code.INVALID_PARAMS


class InvalidWrite(StoreError):
    """put_end/put_revoke for a put that is not the current one (reclaimed, revoked, or the
    key was re-put), or for a key that is already COMPLETE."""

    code = Code.INVALID_WRITE


class InvalidRead(StoreError):
    code = Code.INVALID_READ


class ReplicaNotReady(StoreError):
    """The key has a put in flight (PROCESSING)."""

    code = Code.REPLICA_IS_NOT_READY


class ObjectNotFound(StoreError, KeyError):
    code = Code.OBJECT_NOT_FOUND

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else code_name(self.code)


class ObjectExists(StoreError):
    code = Code.OBJECT_ALREADY_EXISTS


class ObjectHasLease(StoreError):
    """A reader holds a lease on the object: it cannot be removed or overwritten now."""

    code = Code.OBJECT_HAS_LEASE


class LeaseExpired(StoreError):
    """The read lease ran out before the copy finished; the bytes were discarded."""

    code = Code.LEASE_EXPIRED


class ReplicaGone(StoreError):
    code = Code.REPLICA_IS_GONE


class TransferFailed(StoreError):
    code = Code.TRANSFER_FAIL


class StoreUnavailable(StoreError):
    """The master (or a storage node) did not answer within the bounded retries."""

    code = Code.RPC_FAIL


class NotEvictable(StoreError):
    code = Code.NOT_EVICTABLE


class NotRegistered(StoreError, LookupError):
    code = Code.NOT_REGISTERED


class StoreTimeout(StoreError, TimeoutError):
    code = Code.TIMEOUT


class AuthFailed(StoreError):
    code = Code.AUTH_FAILED


class SessionExpired(StoreUnavailable):
    """The master does not know the client's session (it expired, or a memory-mode master
    restarted): the request was *not* applied now, and the client may open a new session
    and send it again. Not sent for a seq whose result was evicted (that one may have been
    applied once already; it stays a plain StoreUnavailable)."""

    code = Code.SESSION_EXPIRED


_TABLE: ErrorTable[StoreError] = ErrorTable(
    StoreError,
    (
        InternalError,
        BufferOverflow,
        SegmentNotFound,
        SegmentExists,
        NodeNotFound,
        NoSpace,
        InvalidKey,
        InvalidParams,
        InvalidWrite,
        InvalidRead,
        ReplicaNotReady,
        ObjectNotFound,
        ObjectExists,
        ObjectHasLease,
        LeaseExpired,
        ReplicaGone,
        TransferFailed,
        StoreUnavailable,
        NotEvictable,
        NotRegistered,
        StoreTimeout,
        AuthFailed,
        SessionExpired,
    ),
    # An unknown code still travels with the error (a newer peer's code is not lost).
    unknown=lambda code, msg: StoreError(msg, code),  # type: ignore[arg-type]
)
ERROR_CLASSES: dict[int, type[StoreError]] = _TABLE.by_code  # type: ignore[assignment]


def code_name(code: int) -> str:
    """``"OBJECT_NOT_FOUND"`` for -704; ``"CODE(-12345)"`` for codes outside the table."""
    try:
        return Code(code).name
    except ValueError:
        return f"CODE({code})"


def error_for(code: int, msg: str = "") -> StoreError:
    """The exception for a non-zero wire ``code`` (an unknown code gives a plain
    :class:`StoreError` carrying it)."""
    return _TABLE.error_for(code, msg or code_name(code))


def raise_for(code: int, msg: str = "") -> None:
    """Raise :func:`error_for` unless ``code`` is 0."""
    if code:
        raise error_for(code, msg)
