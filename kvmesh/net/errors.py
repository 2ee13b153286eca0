"""Errors of :mod:`kvmesh.net`.

Messages never carry more than :data:`MAX_ECHO` characters of anything a peer sent (see
:func:`clip`), and never a token.
"""

from __future__ import annotations

MAX_ECHO = 200


def clip(value: object, limit: int = MAX_ECHO) -> str:
    """``repr`` of a peer-sent value, cut to ``limit`` characters (safe to log or echo)."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


class NetError(Exception):
    """Base class of every kvmesh.net error."""


#: What reading or writing an asyncio stream can raise when the connection fails, on the
#: standard library's loop and on uvloop: ``OSError`` (``ConnectionError``, ``TimeoutError``,
#: ``ssl.SSLError``), ``EOFError`` (``asyncio.IncompleteReadError``), :class:`NetError`, and
#: ``RuntimeError``: uvloop raises it ("unable to perform operation on <TCPTransport
#: closed=True ...>; the handler is closed") for a write to a connection the peer reset,
#: where the standard library raises ``ConnectionResetError`` from ``drain``. A loop that
#: names fewer ends on one event loop and not the other.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError, RuntimeError, NetError)


class HandshakeError(NetError):
    """The peer broke the handshake protocol (undecodable frame, wrong service or version).

    ``code`` is the refusal code sent to (or received from) the peer; ``reply`` is the encoded
    ``Refused`` frame a server should send before closing (None on the client side).
    """

    def __init__(self, message: str, code: str = "protocol", reply: bytes | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reply = reply


class AuthFailed(HandshakeError):
    """The peer could not prove it knows the shared secret (or refused ours)."""

    def __init__(self, message: str, code: str = "auth", reply: bytes | None = None) -> None:
        super().__init__(message, code, reply)


class FrameTooLarge(NetError):
    """A length prefix announced more than the frame limit; nothing was allocated for it."""


class DeadlineExceeded(NetError, TimeoutError):
    """An operation bounded by a :class:`~kvmesh.net.limits.Deadline` ran past it."""


class HandshakeTimeout(DeadlineExceeded):
    """The handshake did not complete within its one absolute deadline."""


class PeerClosed(NetError, ConnectionError):
    """The peer closed the connection (EOF) in the middle of a frame or handshake."""


class InsecureBind(NetError, ValueError):
    """Refused to listen on a non-loopback address without authentication."""
