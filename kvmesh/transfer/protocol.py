"""The control protocol: messages and their framing on the engine's control connections.

Every message is a msgspec Struct in one tagged union, sent as a :mod:`kvmesh.net` frame
(4-byte little-endian length, msgpack body). Bulk bytes never go through msgpack: a
``WriteReq`` frame is followed by ``total`` raw payload bytes, and a ``ReadResp`` frame
likewise; the TCP transport (``transports/tcp.py``) moves them straight between registered
memory and the socket.

A connection opens with the shared :mod:`kvmesh.net` handshake for service ``"transfer"``
(server id and client id: the engines' ``engine_id``; the ``info`` blobs are
:class:`ServerInfo` / :class:`ClientInfo`). After that the client sends requests and reads
one reply each (``GetSegment`` -> ``SegmentInfo``, ``WriteReq`` + payload -> ``Ack``,
``ReadReq`` -> ``ReadResp`` + payload, ...). A connection opened with ``ClientInfo(watch=True)``
instead receives pushed ``SegmentRemoved``/``Bye`` frames; its closing tells the client that
the peer is gone.

Every field a peer sends is bounded in the types below (``Meta``) or, where the bound is a
setting (pieces and bytes per request), checked by the server before any work.
"""

from __future__ import annotations

import socket
from typing import Annotated, TypeVar

import msgspec

from kvmesh.net import (
    Deadline,
    DeadlineExceeded,
    FrameTooLarge,
    PeerClosed,
    encode_frame,
    read_frame,
)
from kvmesh.net.addr import split_host_port as _split
from kvmesh.net.errors import clip

from .errors import InvalidArgument, PeerDeadError, ProtocolError, TransferTimeout
from .types import SegmentDescriptor

PROTOCOL_VERSION = 2
SERVICE = "transfer"  # the kvmesh.net service name bound into the handshake
MAX_FRAME = 64 << 20  # largest reply a client accepts (a segment list); requests: see tcp.py
MAX_NAME = 1024  # segment names, transport kinds
MAX_MESSAGE = 4096  # error messages

_Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
_Id = Annotated[str, msgspec.Meta(max_length=256)]
_Count = Annotated[int, msgspec.Meta(ge=0)]


class ServerInfo(msgspec.Struct, frozen=True):
    """``info`` of the server's handshake challenge."""

    node_id: _Id
    host_id: _Id
    version: int = PROTOCOL_VERSION


class ClientInfo(msgspec.Struct, frozen=True):
    """``info`` of the client's hello."""

    node_id: _Id
    watch: bool = False
    version: int = PROTOCOL_VERSION


class Error(msgspec.Struct, tag="error"):
    code: Annotated[str, msgspec.Meta(max_length=64)]
    message: Annotated[str, msgspec.Meta(max_length=MAX_MESSAGE)]


class GetSegment(msgspec.Struct, tag="get_segment"):
    name: _Name


class SegmentInfo(msgspec.Struct, tag="segment_info"):
    desc: SegmentDescriptor


class ListSegments(msgspec.Struct, tag="list_segments"):
    pass


class SegmentList(msgspec.Struct, tag="segment_list"):
    descs: list[SegmentDescriptor]


class Ping(msgspec.Struct, tag="ping"):
    seq: int


class Pong(msgspec.Struct, tag="pong"):
    seq: int


class WriteReq(msgspec.Struct, tag="write"):
    """Followed by ``total`` payload bytes: the pieces, in request order."""

    segment: _Name
    seg_id: _Count
    offsets: bytes  # little-endian uint64 array
    lengths: bytes  # little-endian uint64 array
    total: _Count


class Ack(msgspec.Struct, tag="ack"):
    total: int


class ReadReq(msgspec.Struct, tag="read"):
    segment: _Name
    seg_id: _Count
    offsets: bytes
    lengths: bytes
    total: _Count


class ReadResp(msgspec.Struct, tag="read_resp"):
    """Followed by ``total`` payload bytes."""

    total: int


class Call(msgspec.Struct, tag="call"):
    kind: Annotated[str, msgspec.Meta(max_length=64)]  # TransportKind value
    payload: bytes


class CallReply(msgspec.Struct, tag="call_reply"):
    payload: bytes


class SegmentRemoved(msgspec.Struct, tag="segment_removed"):
    name: _Name
    seg_id: int


class Bye(msgspec.Struct, tag="bye"):
    reason: Annotated[str, msgspec.Meta(max_length=MAX_MESSAGE)]


Message = (
    Error
    | GetSegment
    | SegmentInfo
    | ListSegments
    | SegmentList
    | Ping
    | Pong
    | WriteReq
    | Ack
    | ReadReq
    | ReadResp
    | Call
    | CallReply
    | SegmentRemoved
    | Bye
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return encode_frame(_encoder.encode(msg))


def encode_info(info: ServerInfo | ClientInfo) -> bytes:
    return _encoder.encode(info)


_Info = TypeVar("_Info", ServerInfo, ClientInfo)


def decode_info(raw: bytes, cls: type[_Info]) -> _Info:
    """The handshake ``info`` blob of the other side."""
    try:
        return msgspec.msgpack.decode(raw, type=cls)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad handshake info from peer: {clip(str(exc))}") from None


def error_reply(exc: BaseException, code: str | None = None) -> Error:
    """The ``Error`` frame for a refusal (message bounded)."""
    return Error(code or getattr(exc, "code", "transfer"), str(exc)[:1000])


def io_error(exc: BaseException, what: str) -> Exception:
    """Map a socket/net failure to the transfer error a caller expects."""
    if isinstance(exc, TimeoutError):  # socket.timeout and kvmesh.net deadlines alike
        return TransferTimeout(f"{what}: timed out")
    if isinstance(exc, FrameTooLarge):
        return ProtocolError(f"{what}: {exc}")
    return PeerDeadError(f"{what}: {exc.__class__.__name__}: {exc}")


def send_msg(sock: socket.socket, msg: Message) -> None:
    try:
        sock.sendall(encode(msg))
    except OSError as exc:
        raise io_error(exc, "sending to peer") from None


def decode(body: bytes | bytearray | memoryview) -> Message:
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable frame from peer: {clip(str(exc))}") from None


def decode_request(body: bytes | bytearray | memoryview) -> Message:
    """Server side: a malformed field is the peer's invalid argument, garbage a protocol error."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(f"invalid request: {clip(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable frame from peer: {clip(str(exc))}") from None


def recv_msg(
    sock: socket.socket, max_frame: int = MAX_FRAME, deadline: Deadline | None = None
) -> Message:
    """Read and decode one frame (within ``deadline``, else the socket's timeout)."""
    try:
        body = read_frame(sock, max_frame, deadline)
    except PeerClosed:
        raise PeerDeadError("peer closed the connection") from None
    except (OSError, DeadlineExceeded, FrameTooLarge) as exc:
        raise io_error(exc, "receiving from peer") from None
    return decode(body)


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``; an empty host (``":port"``)
    is loopback. (:func:`kvmesh.net.addr.split_host_port`, its errors as InvalidArgument.)"""
    if isinstance(address, str) and address.startswith(":"):
        address = "127.0.0.1" + address
    try:
        return _split(address)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(str(exc)) from None
