"""Wire protocol of a replica's client port (served by ``server.py``, spoken by
``client.py``), and the service names both replica ports authenticate under.

A connection starts with the :mod:`kvmesh.net` handshake (service :data:`CLIENT_SERVICE`),
then carries frames ``[len u32 LE][msgpack]`` (:func:`kvmesh.net.framing.encode_frame`):
:data:`Request` structs from the client, :class:`Response` structs from the replica. Every
request has a ``rid`` echoed in its response, so requests pipeline on one connection.
Results are msgpack bytes (``Response.result``); errors carry ``kind``, a code of
:data:`kvmesh.replog.errors.ERROR_CODES`, and for ``not_leader`` the leader's id and client
address.

Sessions: :class:`ReqRegister` answers ``[client_id, token]``; the token (16 random bytes,
replicated in the session's Register entry) must accompany every :class:`ReqSubmit` of that
session, so one client cannot act in another's session (``session_denied``).
"""

from __future__ import annotations

import msgspec

__all__ = [
    "CLIENT_SERVICE",
    "MAX_REQUEST",
    "MAX_RESPONSE",
    "PEER_SERVICE",
    "SESSION_TOKEN_BYTES",
    "ReqRead",
    "ReqRegister",
    "ReqSnapshot",
    "ReqStatus",
    "ReqSubmit",
    "Request",
    "Response",
    "SessionGrant",
    "decode_request",
    "decode_response",
    "encode",
]

PEER_SERVICE = "replog-peer"
"""Handshake service of the replica-to-replica port (the peer id is the node id)."""
CLIENT_SERVICE = "replog-client"
"""Handshake service of the client port."""

SESSION_TOKEN_BYTES = 16
MAX_REQUEST = 4 << 20
"""Default cap on one client request frame (per server: ``ServerLimits.max_request``,
``--max-request-kb``); docs/replog.md. With the 64 MiB budget of incomplete requests across
connections, at least 16 clients can each be midway through a largest frame."""
MAX_RESPONSE = 256 << 20
"""Cap on one response frame a client accepts."""


class ReqRegister(msgspec.Struct, tag=1, array_like=True, frozen=True):
    """Open an exactly-once session; result: :class:`SessionGrant`."""

    rid: int


class ReqSubmit(msgspec.Struct, tag=2, array_like=True, frozen=True):
    """Apply ``body`` (a state-machine command) exactly once for ``(client_id, seq)``;
    ``token`` is the session's (from :class:`SessionGrant`)."""

    rid: int
    client_id: int
    seq: int
    body: bytes
    ack: int = 0
    token: bytes = b""


class ReqRead(msgspec.Struct, tag=3, array_like=True, frozen=True):
    """Linearizable read: read-index barrier, then the state machine's ``query(body)``."""

    rid: int
    body: bytes


class ReqStatus(msgspec.Struct, tag=4, array_like=True, frozen=True):
    """Node status (a dict), no leader needed. ``digest``: include the state machine's
    ``digest()`` (costly on a large state)."""

    rid: int
    digest: bool = False


class ReqSnapshot(msgspec.Struct, tag=5, array_like=True, frozen=True):
    """Admin (authenticated connections only): take a snapshot now; result: its index (0 if
    one was already running). ``reset_lag``: clear the event-loop lag statistics first."""

    rid: int
    reset_lag: bool = False


Request = ReqRegister | ReqSubmit | ReqRead | ReqStatus | ReqSnapshot


class Response(msgspec.Struct, array_like=True, frozen=True):
    rid: int
    ok: bool
    result: bytes = b""  # msgpack of the result when ok
    kind: str = ""  # an error code (kvmesh.replog.errors) when not ok
    error: str = ""
    leader_id: int = 0
    leader_addr: str = ""


class SessionGrant(msgspec.Struct, array_like=True, frozen=True):
    """Result of :class:`ReqRegister`."""

    client_id: int
    token: bytes


_enc = msgspec.msgpack.Encoder()
_req_dec = msgspec.msgpack.Decoder(Request)
_resp_dec = msgspec.msgpack.Decoder(Response)


def encode(msg: msgspec.Struct) -> bytes:
    return _enc.encode(msg)


def decode_request(buf: bytes | memoryview) -> Request:
    """Raises ``msgspec.DecodeError`` / ``msgspec.ValidationError`` on malformed input."""
    return _req_dec.decode(buf)


def decode_response(buf: bytes | memoryview) -> Response:
    return _resp_dec.decode(buf)
