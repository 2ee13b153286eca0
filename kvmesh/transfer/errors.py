"""Exceptions raised by the transfer engine.

Every failure has its own class so callers (the store client, the SGLang plugins) can react
precisely: a bad request is a bug in the caller, a dead peer is an operational event, a timeout
may be retried. All derive from :class:`TransferError`; the input errors also derive from the
matching builtin (``ValueError``, ``IndexError``, ``LookupError``) so generic handlers work.

The control protocol carries errors as ``(code, message)``; :data:`ERROR_CODES` maps codes back
to classes on the receiving side, so a remote refusal raises the same class locally.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvmesh.errors import ErrorTable


class TransferError(Exception):
    """Base class of every kvmesh.transfer error."""

    code = "transfer"


class InvalidArgument(TransferError, ValueError):
    """A malformed argument (non-contiguous array, read-only buffer, bad address string...)."""

    code = "invalid_argument"


class InvalidLength(InvalidArgument):
    """A transfer length or registration size that is zero, negative or inconsistent."""

    code = "invalid_length"


class OutOfBounds(TransferError, IndexError):
    """A request that reaches outside the local region or the remote segment."""

    code = "out_of_bounds"


class NotRegistered(TransferError, LookupError):
    """Memory that was never registered with the engine (or was unregistered)."""

    code = "not_registered"


class SegmentNotFound(TransferError, LookupError):
    """No segment of that name is published by the peer (or it was removed/replaced)."""

    code = "segment_not_found"


class SegmentExists(TransferError, ValueError):
    """A segment name that is already published by this engine."""

    code = "segment_exists"


class TensorMismatch(InvalidArgument):
    """A tensor whose dtype, shape or size does not match the exposed peer tensor."""

    code = "tensor_mismatch"


class RequestTooLarge(InvalidArgument):
    """A request over the owner's limits (pieces or bytes per request, frame size)."""

    code = "too_large"


class AuthError(TransferError):
    """The peer refused our shared-secret token, or we refused theirs."""

    code = "auth"


class PeerDeadError(TransferError):
    """The peer process died, closed or became unreachable."""

    code = "peer_dead"


class TransferTimeout(TransferError, TimeoutError):
    """A transfer or a control call did not finish within its deadline."""

    code = "timeout"


class TransportUnavailable(TransferError):
    """No enabled transport can serve the request (or a forced transport cannot)."""

    code = "transport_unavailable"


class ProtocolError(TransferError):
    """The peer sent something that violates the control protocol."""

    code = "protocol"


class BatchStateError(TransferError):
    """A batch used in the wrong state (adding after submit, submitting twice, after free)."""

    code = "batch_state"


class EngineClosed(TransferError):
    """The engine (or the memory region) was closed while in use."""

    code = "closed"


class Cancelled(TransferError):
    """The batch was cancelled (freed) before this request ran."""

    code = "cancelled"


class ChecksumMismatch(TransferError):
    """Bytes read back do not match the checksum recorded when they were written.

    ``bad`` holds the indices of the ranges that differ (empty when the error came over the
    wire, which carries only the message).
    """

    code = "checksum"

    def __init__(self, message: str = "", bad: Any = None) -> None:
        super().__init__(message)
        self.bad = np.empty(0, np.int64) if bad is None else bad


class DiskIOError(TransferError):
    """A read or write of a disk segment's file failed (EIO, a file truncated under us...)."""

    code = "disk_io"


_TABLE: ErrorTable[TransferError] = ErrorTable(
    TransferError,
    (
        TransferError,
        InvalidArgument,
        InvalidLength,
        OutOfBounds,
        NotRegistered,
        SegmentNotFound,
        SegmentExists,
        TensorMismatch,
        RequestTooLarge,
        AuthError,
        PeerDeadError,
        TransferTimeout,
        TransportUnavailable,
        ProtocolError,
        BatchStateError,
        EngineClosed,
        Cancelled,
        ChecksumMismatch,
        DiskIOError,
    ),
)
ERROR_CODES: dict[str, type[TransferError]] = _TABLE.by_code  # type: ignore[assignment]


def error_from_code(code: str, message: str) -> TransferError:
    """Rebuild a local exception from a wire ``(code, message)`` pair."""
    return _TABLE.error_for(code, message)
