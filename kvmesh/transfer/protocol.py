"""The control protocol: messages, framing and copy-free socket helpers.

Every message is a msgspec Struct in one tagged union, sent as a 4-byte little-endian length
followed by its msgpack body. Bulk bytes never go through msgpack: a ``WriteReq`` frame is
followed by ``total`` raw payload bytes, and a ``ReadResp`` frame likewise; both sides move
them with ``sendmsg``/``recv_into`` straight between registered memory and the socket.

Connection opening (both sides prove they hold the same optional shared secret)::

    server -> Challenge(nonce, identity, auth)
    client -> Hello(identity, client_nonce, mac = HMAC(token, nonce + client engine id))
    server -> Welcome(mac = HMAC(token, client_nonce + server engine id)) | Error("auth")

After that the client sends requests and reads one reply each (``GetSegment`` ->
``SegmentInfo``, ``WriteReq`` + payload -> ``Ack``, ``ReadReq`` -> ``ReadResp`` + payload,
...). A connection opened with ``Hello(watch=True)`` instead receives pushed
``SegmentRemoved``/``Bye`` frames; its closing tells the client that the peer is gone.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
from typing import Union

import msgspec

from .errors import PeerDeadError, ProtocolError, TransferTimeout
from .types import SegmentDescriptor

PROTOCOL_VERSION = 1
MAX_FRAME = 64 << 20  # a frame is metadata only; anything bigger is a protocol violation
_LEN = struct.Struct("<I")
# iovecs per sendmsg / recvmsg_into call (IOV_MAX is 1024 on Linux). A receive returns what
# has arrived (often 64-256 KiB on loopback) and CPython acquires every buffer of the list on
# each call, so receives take fewer at a time than sends.
_IOV_SEND = 256
_IOV_RECV = 64
_SMALL_PIECE = 64 << 10  # below this, scatter many pieces per syscall


class Challenge(msgspec.Struct, tag="challenge"):
    nonce: bytes
    node_id: str
    engine_id: str
    host_id: str
    version: int
    auth: bool  # the server has a token configured


class Hello(msgspec.Struct, tag="hello"):
    node_id: str
    engine_id: str
    nonce: bytes
    mac: bytes | None
    version: int = PROTOCOL_VERSION
    watch: bool = False


class Welcome(msgspec.Struct, tag="welcome"):
    mac: bytes | None


class Error(msgspec.Struct, tag="error"):
    code: str
    message: str


class GetSegment(msgspec.Struct, tag="get_segment"):
    name: str


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

    segment: str
    seg_id: int
    offsets: bytes  # little-endian uint64 array
    lengths: bytes  # little-endian uint64 array
    total: int


class Ack(msgspec.Struct, tag="ack"):
    total: int


class ReadReq(msgspec.Struct, tag="read"):
    segment: str
    seg_id: int
    offsets: bytes
    lengths: bytes
    total: int


class ReadResp(msgspec.Struct, tag="read_resp"):
    """Followed by ``total`` payload bytes."""

    total: int


class Call(msgspec.Struct, tag="call"):
    kind: str  # TransportKind value
    payload: bytes


class CallReply(msgspec.Struct, tag="call_reply"):
    payload: bytes


class SegmentRemoved(msgspec.Struct, tag="segment_removed"):
    name: str
    seg_id: int


class Bye(msgspec.Struct, tag="bye"):
    reason: str


Message = Union[
    Challenge,
    Hello,
    Welcome,
    Error,
    GetSegment,
    SegmentInfo,
    ListSegments,
    SegmentList,
    Ping,
    Pong,
    WriteReq,
    Ack,
    ReadReq,
    ReadResp,
    Call,
    CallReply,
    SegmentRemoved,
    Bye,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def mac(token: str | None, nonce: bytes, engine_id: str) -> bytes | None:
    """HMAC proving knowledge of ``token`` for this nonce and identity (None without a token)."""
    if token is None:
        return None
    return hmac.new(token.encode(), nonce + engine_id.encode(), hashlib.sha256).digest()


def mac_ok(token: str | None, nonce: bytes, engine_id: str, got: bytes | None) -> bool:
    want = mac(token, nonce, engine_id)
    if want is None or got is None:
        return want is None and got is None
    return hmac.compare_digest(want, got)


def encode(msg: Message) -> bytes:
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


def _io_error(exc: BaseException, what: str) -> Exception:
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return TransferTimeout(f"{what}: timed out")
    return PeerDeadError(f"{what}: {exc.__class__.__name__}: {exc}")


def send_msg(sock: socket.socket, msg: Message) -> None:
    try:
        sock.sendall(encode(msg))
    except OSError as exc:
        raise _io_error(exc, "sending to peer") from None


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket; EOF before it is full means the peer is gone."""
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise PeerDeadError("peer closed the connection")
        view = view[n:]


def recv_msg(sock: socket.socket, buf: bytearray | None = None) -> Message:
    """Read one frame. ``buf`` is a reusable scratch buffer (grown as needed)."""
    try:
        head = bytearray(4)
        recv_exact(sock, memoryview(head))
        (size,) = _LEN.unpack(head)
        if size > MAX_FRAME:
            raise ProtocolError(f"frame of {size} bytes exceeds the {MAX_FRAME} byte limit")
        if buf is None or len(buf) < size:
            buf = bytearray(max(size, 256))
        view = memoryview(buf)[:size]
        recv_exact(sock, view)
    except OSError as exc:
        raise _io_error(exc, "receiving from peer") from None
    try:
        return _decoder.decode(view)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable frame from peer: {exc}") from None


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Send every byte of ``views`` in order, gathering many buffers per syscall."""
    i = 0
    n = len(views)
    while i < n:
        chunk = views[i : i + _IOV_SEND]
        sent = sock.sendmsg(chunk)
        # Skip fully sent buffers; keep the unsent tail of a partially sent one.
        for v in chunk:
            lv = len(v)
            if sent >= lv:
                sent -= lv
                i += 1
            else:
                if sent:
                    views[i] = v[sent:]
                break


def recv_into_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every buffer of ``views`` in order, straight from the socket (no staging copy)."""
    i = 0
    n = len(views)
    while i < n:
        cur = views[i]
        if len(cur) >= _SMALL_PIECE:
            got = sock.recv_into(cur)
            if got == 0:
                raise PeerDeadError("peer closed the connection mid-transfer")
            if got == len(cur):
                i += 1
            else:
                views[i] = cur[got:]
            continue
        chunk = views[i : i + _IOV_RECV]
        got = sock.recvmsg_into(chunk)[0]
        if got == 0:
            raise PeerDeadError("peer closed the connection mid-transfer")
        for v in chunk:
            lv = len(v)
            if got >= lv:
                got -= lv
                i += 1
            else:
                if got:
                    views[i] = v[got:]
                break


def drain(sock: socket.socket, nbytes: int) -> None:
    """Read and discard ``nbytes`` (payload of a refused request), keeping the stream in sync."""
    scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
    while nbytes > 0:
        got = sock.recv_into(scratch[: min(nbytes, len(scratch))])
        if got == 0:
            raise PeerDeadError("peer closed the connection mid-transfer")
        nbytes -= got


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``."""
    from .errors import InvalidArgument

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidArgument(f"bad address {address!r}: expected 'host:port'")
    return host.strip("[]") or "127.0.0.1", int(port)
