"""NIXL's exceptions mapped to kvmesh errors.

NIXL raises (``nixlRemoteDisconnectError`` ...) instead of returning ``"ERR"``; every call
into it goes through :func:`translate`, so callers only ever see
:class:`~kvmesh.transfer.errors.TransferError` subclasses whose message names the operation.
"""

from __future__ import annotations

from typing import Any

from ..errors import (
    Cancelled,
    InvalidArgument,
    NotRegistered,
    PeerDeadError,
    TransferError,
    TransportUnavailable,
)

__all__ = ["error_map", "translate"]

_BY_NAME: dict[str, type[TransferError]] = {
    "nixlRemoteDisconnectError": PeerDeadError,
    "nixlNotFoundError": NotRegistered,
    "nixlInvalidParamError": InvalidArgument,
    "nixlCancelledError": Cancelled,
    "nixlNotSupportedError": TransportUnavailable,
    "nixlNotAllowedError": TransferError,
    "nixlBackendError": TransferError,
    "nixlMismatchError": TransferError,
    "nixlNotPostedError": TransferError,
    "nixlRepostActiveError": TransferError,
    "nixlUnknownError": TransferError,
}

_HINTS: dict[type[TransferError], str] = {
    PeerDeadError: "the peer agent disconnected or died",
    NotRegistered: "unknown peer agent, or memory not registered on one side",
    InvalidArgument: "NIXL rejected a parameter",
    TransportUnavailable: "not supported by the UCX backend here",
}


def error_map(bind: Any) -> dict[type, type[TransferError]]:
    """NIXL exception class -> kvmesh error class, for the classes ``bind`` defines."""
    out: dict[type, type[TransferError]] = {}
    for name, cls in _BY_NAME.items():
        nixl_cls = getattr(bind, name, None)
        if isinstance(nixl_cls, type):
            out[nixl_cls] = cls
    return out


def translate(
    errors: dict[type, type[TransferError]], exc: BaseException, what: str
) -> TransferError:
    """The kvmesh error for ``exc`` raised by NIXL while doing ``what``."""
    cls = errors.get(type(exc))
    if cls is None:
        return TransferError(f"{what}: {type(exc).__name__}: {exc}")
    hint = _HINTS.get(cls, "NIXL error")
    return cls(f"{what}: {hint} ({type(exc).__name__}: {exc})")
