"""Mutual challenge-response on per-(role, id) keys: a sans-I/O core and its two drivers.

Every connection opens with (frames of :mod:`kvmesh.net.framing`, msgspec msgpack bodies)::

    server -> Challenge(nonce, server_id, service, version, auth_required, info)
    client -> Hello(client_id, client_nonce, mac, version, info, role)
    server -> Welcome(mac) | Refused(code, message)

    K          = key(role, client_id)   (kvmesh.net.identity: derived from the cluster secret)
    client mac = HMAC-SHA256(K, "kvmesh-net/2 c" | service | nonce | client_nonce | role
                             | client_id | client info | server_id)
    server mac = HMAC-SHA256(K, "kvmesh-net/2 s" | service | client_nonce | nonce | role
                             | server_id | server info | client_id)

(each part after the label prefixed with its 4-byte little-endian length). The client claims
a role (``replica``, ``node``, ``client``) and an id and proves it holds that pair's key; the
server derives the key it expects for the claim (it holds the cluster secret, or -- for the
client role -- a credential carrying the client key, :meth:`SecurityConfig.key_for`) and
refuses a proof made with any other key. So a client credential proves only "a client", a
node credential only "node N". After success the server knows ``peer_role`` and ``peer_id``;
its ``accept(role, id)`` policy (e.g. "replicas of the current membership only") is applied
to the authenticated claim, and with mutual TLS the certificate must name the claim too
(:func:`~kvmesh.net.security.check_cert_identity`). The server's proof uses the same key,
so the client learns the server holds the secret (or, for a client key, some credential).
``service`` is bound into both proofs, so a proof made for one port cannot be used at
another. ``info`` is a small opaque blob each side may send (the transfer engine sends its
node and host ids); it is covered by the MACs. No key crosses the wire.

Without keys on both sides the exchange still runs (ids, role, service and version are
checked, ``accept`` applies to the claim) but proves nothing; a side with keys refuses a peer
without them.

Every field has a size cap (ids <= :data:`MAX_ID_BYTES` bytes, nonces 16-64 bytes, info <=
:data:`MAX_INFO`), and handshake frames are capped at :data:`PREAUTH_MAX_FRAME`. The drivers
run the whole exchange under ONE absolute deadline (:data:`DEFAULT_DEADLINE_S`).

The core objects do no I/O and read no clock: :class:`ServerHandshake` and
:class:`ClientHandshake` take frame bodies and return frames to send.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
import socket
import ssl
from collections.abc import Callable, Coroutine, Iterator, Mapping
from typing import Annotated, Any

import msgspec

from .errors import AuthFailed, DeadlineExceeded, HandshakeError, HandshakeTimeout, clip
from .framing import aread_frame, encode_frame, read_frame, send_frame
from .identity import CLIENT, Role
from .limits import Deadline
from .security import SecurityConfig, check_cert_identity

VERSION = 2
PREAUTH_MAX_FRAME = 4 << 10  # no handshake frame is bigger; a larger prefix closes the connection
DEFAULT_DEADLINE_S = 5.0
MAX_ID_BYTES = 256
MAX_INFO = 1024
NONCE_BYTES = 32

_Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_BYTES)]
_Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
_Mac = Annotated[bytes, msgspec.Meta(max_length=64)]
_Info = Annotated[bytes, msgspec.Meta(max_length=MAX_INFO)]
_Service = Annotated[str, msgspec.Meta(max_length=64)]


class Challenge(msgspec.Struct, tag="challenge", frozen=True):
    nonce: _Nonce
    server_id: _Id
    service: _Service
    version: int
    auth_required: bool
    info: _Info = b""


class Hello(msgspec.Struct, tag="hello", frozen=True):
    client_id: _Id
    client_nonce: _Nonce
    mac: _Mac | None
    version: int = VERSION
    info: _Info = b""
    role: Role = CLIENT


# A server's policy on an authenticated claim: the reason to refuse (role, id), or None.
Accept = Callable[[str, str], "str | None"]


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    mac: _Mac | None


class Refused(msgspec.Struct, tag="refused", frozen=True):
    code: Annotated[str, msgspec.Meta(max_length=32)]
    message: Annotated[str, msgspec.Meta(max_length=256)]


_encoder = msgspec.msgpack.Encoder()
_hello_decoder = msgspec.msgpack.Decoder(Hello)
_server_decoder = msgspec.msgpack.Decoder(Challenge | Welcome | Refused)


def _frame(msg: msgspec.Struct) -> bytes:
    return encode_frame(_encoder.encode(msg))


def _id_ok(value: str) -> bool:
    return len(value.encode("utf-8", "surrogatepass")) <= MAX_ID_BYTES


def _mac(key: bytes, label: bytes, *parts: bytes | str) -> bytes:
    h = hmac.new(key, b"kvmesh-net/2 " + label, hashlib.sha256)
    for p in parts:
        raw = p.encode() if isinstance(p, str) else p
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    return h.digest()


def client_mac(
    key: bytes,
    service: str,
    nonce: bytes,
    client_nonce: bytes,
    role: str,
    client_id: str,
    info: bytes,
    server_id: str,
) -> bytes:
    """The client's proof (exposed for tests of forged and replayed proofs)."""
    return _mac(key, b"c", service, nonce, client_nonce, role, client_id, info, server_id)


def server_mac(
    key: bytes,
    service: str,
    client_nonce: bytes,
    nonce: bytes,
    role: str,
    server_id: str,
    info: bytes,
    client_id: str,
) -> bytes:
    """The server's proof."""
    return _mac(key, b"s", service, client_nonce, nonce, role, server_id, info, client_id)


class ServerHandshake:
    """Server side of one connection's handshake: ``start()``, then ``receive(hello_body)``.

    ``receive`` returns the Welcome frame or raises :class:`AuthFailed` /
    :class:`HandshakeError` whose ``reply`` is the Refused frame to send before closing.
    After success ``peer_role``, ``peer_id`` and ``peer_info`` hold what the (authenticated)
    client claimed and sent. ``accept(role, id)`` returns why a claim is refused (code
    ``forbidden``), or None; ``peer_cert``: the client's verified TLS certificate (the
    drivers fill it in), which must name the claim (module docstring).
    """

    def __init__(
        self,
        sec: SecurityConfig,
        service: str,
        server_id: str,
        *,
        info: bytes = b"",
        nonce: bytes | None = None,
        accept: Accept | None = None,
        peer_cert: Mapping[str, Any] | None = None,
    ) -> None:
        if not _id_ok(server_id) or len(info) > MAX_INFO or len(service) > 64:
            raise ValueError("server id, service or info exceeds its size cap")
        self.sec = sec
        self.service = service
        self.server_id = server_id
        self.info = bytes(info)
        self.nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_BYTES)
        self.accept = accept
        self.peer_cert = peer_cert
        self.peer_role: str | None = None
        self.peer_id: str | None = None
        self.peer_info: bytes = b""
        self.done = False
        self._started = False

    @property
    def started(self) -> bool:
        """``start()`` was called (the Challenge is sent or on its way)."""
        return self._started

    def start(self) -> bytes:
        """The Challenge frame (send it first)."""
        if self._started:
            raise HandshakeError("handshake already started")
        self._started = True
        return _frame(
            Challenge(
                self.nonce,
                self.server_id,
                self.service,
                VERSION,
                self.sec.authenticates,
                self.info,
            )
        )

    def _refuse(self, cls: type[HandshakeError], code: str, why: str) -> HandshakeError:
        return cls(why, code=code, reply=_frame(Refused(code, why[:256])))

    def receive(self, body: bytes | bytearray | memoryview) -> bytes:
        if not self._started or self.done:
            raise HandshakeError("unexpected handshake frame")
        try:
            hello = _hello_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise self._refuse(HandshakeError, "protocol", f"bad hello: {clip(str(exc))}") from None
        if hello.version != VERSION:
            raise self._refuse(
                HandshakeError,
                "version",
                f"handshake version {clip(hello.version, 20)} != {VERSION}",
            )
        if not _id_ok(hello.client_id):
            raise self._refuse(HandshakeError, "protocol", "client id too long")
        role, cid = hello.role, hello.client_id
        sec = self.sec
        mac = None
        if sec.authenticates:
            if hello.mac is None:
                raise self._refuse(AuthFailed, "auth", "this server requires a token; none given")
            key = sec.key_for(role, cid)
            if key is None:
                raise self._refuse(AuthFailed, "auth", f"this server cannot verify a {role}")
            want = client_mac(
                key, self.service, self.nonce, hello.client_nonce, role, cid, hello.info,
                self.server_id,
            )  # fmt: skip
            if not hmac.compare_digest(want, hello.mac):
                raise self._refuse(AuthFailed, "auth", f"wrong token or credential for {role}")
            mac = server_mac(
                key, self.service, hello.client_nonce, self.nonce, role, self.server_id,
                self.info, cid,
            )  # fmt: skip
        why = check_cert_identity(sec, self.peer_cert, role, cid)
        if why is None and self.accept is not None:
            why = self.accept(role, cid)
        if why is not None:
            raise self._refuse(AuthFailed, "forbidden", f"{role} {clip(cid, 60)}: {why}")
        self.peer_role = role
        self.peer_id = hello.client_id
        self.peer_info = hello.info
        self.done = True
        return _frame(Welcome(mac))


class ClientHandshake:
    """Client side: ``receive(challenge_body)`` -> Hello frame; ``receive(welcome_body)`` -> None.

    ``role``: the role this side claims (its key: :meth:`SecurityConfig.key_for`).
    Raises :class:`AuthFailed` (wrong proof, refused, token on one side only) or
    :class:`HandshakeError` (wrong service or version, bad frame). After ``done``, ``peer_id``
    and ``peer_info`` are the server's (authenticated when a token is configured).
    """

    def __init__(
        self,
        sec: SecurityConfig,
        service: str,
        client_id: str,
        *,
        info: bytes = b"",
        expect_server_id: str | None = None,
        nonce: bytes | None = None,
        role: Role = CLIENT,
    ) -> None:
        if not _id_ok(client_id) or len(info) > MAX_INFO:
            raise ValueError("client id or info exceeds its size cap")
        self.sec = sec
        self.role = role
        self._key: bytes | None = None
        self.service = service
        self.client_id = client_id
        self.info = bytes(info)
        self.expect_server_id = expect_server_id
        self.nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_BYTES)
        self.peer_id: str | None = None
        self.peer_info: bytes = b""
        self.done = False
        self._challenge: Challenge | None = None

    def receive(self, body: bytes | bytearray | memoryview) -> bytes | None:
        if self.done:
            raise HandshakeError("unexpected frame after the handshake")
        try:
            msg = _server_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HandshakeError(f"bad handshake frame from server: {clip(str(exc))}") from None
        if isinstance(msg, Refused):
            cls = AuthFailed if msg.code in ("auth", "forbidden") else HandshakeError
            raise cls(
                f"server refused the connection ({clip(msg.code, 40)}): {clip(msg.message)}",
                code=msg.code,
            )
        if self._challenge is None:
            if not isinstance(msg, Challenge):
                raise HandshakeError(f"expected a challenge, got {type(msg).__name__}")
            return self._on_challenge(msg)
        if not isinstance(msg, Welcome):
            raise HandshakeError(f"expected welcome, got {type(msg).__name__}")
        ch = self._challenge
        if self._key is not None:
            want = server_mac(
                self._key, self.service, self.nonce, ch.nonce, self.role, ch.server_id, ch.info,
                self.client_id,
            )  # fmt: skip
            if msg.mac is None or not hmac.compare_digest(want, msg.mac):
                raise AuthFailed("the server could not prove it knows the token")
        self.peer_id = ch.server_id
        self.peer_info = ch.info
        self.done = True
        return None

    def _on_challenge(self, ch: Challenge) -> bytes:
        if ch.service != self.service:
            raise HandshakeError(
                f"connected to a {clip(ch.service, 70)} port, expected {self.service!r}",
                code="service",
            )
        if ch.version != VERSION:
            raise HandshakeError(
                f"server speaks handshake version {clip(ch.version, 20)}, we speak {VERSION}",
                code="version",
            )
        if not _id_ok(ch.server_id):
            raise HandshakeError("server id too long")
        if self.expect_server_id is not None and ch.server_id != self.expect_server_id:
            raise HandshakeError(
                f"expected server {self.expect_server_id!r}, found {clip(ch.server_id)}",
                code="identity",
            )
        sec = self.sec
        if not sec.authenticates and ch.auth_required:
            raise AuthFailed("the server requires a token and we have none")
        if sec.authenticates and not ch.auth_required:
            raise AuthFailed(
                "we have a token and the server has none (refusing an unauthenticated peer)"
            )
        mac = None
        if sec.authenticates:
            self._key = sec.key_for(self.role, self.client_id)
            if self._key is None:
                raise AuthFailed(
                    f"our credential ({'/'.join(sec.identity or ())}) cannot speak as "
                    f"{self.role} {clip(self.client_id, 60)}"
                )
            mac = client_mac(
                self._key, self.service, ch.nonce, self.nonce, self.role, self.client_id,
                self.info, ch.server_id,
            )  # fmt: skip
        self._challenge = ch
        return _frame(Hello(self.client_id, self.nonce, mac, VERSION, self.info, self.role))


# --- blocking-socket driver -----------------------------------------------------------------


@contextlib.contextmanager
def _blocking_step(sock: socket.socket) -> Iterator[None]:
    """Timeouts become :class:`HandshakeTimeout`; the socket's own timeout is restored."""
    old = sock.gettimeout()
    try:
        yield
    except TimeoutError as exc:  # DeadlineExceeded and socket.timeout alike
        if isinstance(exc, HandshakeTimeout):
            raise
        raise HandshakeTimeout(f"handshake did not complete in time ({exc})") from None
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(old)


def run_server(sock: socket.socket, hs: ServerHandshake, deadline: Deadline) -> str:
    """Drive ``hs`` over a blocking socket within ``deadline``; returns the client's id.

    On refusal the ``Refused`` frame is sent (best effort) before the error propagates. The
    socket's own timeout is restored afterwards.
    """
    if hs.peer_cert is None and isinstance(sock, ssl.SSLSocket):
        hs.peer_cert = sock.getpeercert() or None
    with _blocking_step(sock):
        if not hs.started:
            send_frame(sock, hs.start(), deadline)
        body = read_frame(sock, PREAUTH_MAX_FRAME, deadline)
        try:
            reply = hs.receive(body)
        except HandshakeError as exc:
            if exc.reply is not None:
                with contextlib.suppress(OSError, DeadlineExceeded):
                    send_frame(sock, exc.reply, deadline)
            raise
        send_frame(sock, reply, deadline)
    return hs.peer_id  # type: ignore[return-value]  # set by a successful receive()


def run_client(sock: socket.socket, hs: ClientHandshake, deadline: Deadline) -> str:
    """Drive ``hs`` over a blocking socket within ``deadline``; returns the server's id."""
    with _blocking_step(sock):
        while not hs.done:
            out = hs.receive(read_frame(sock, PREAUTH_MAX_FRAME, deadline))
            if out is not None:
                send_frame(sock, out, deadline)
    return hs.peer_id  # type: ignore[return-value]


def server_handshake(
    sock: socket.socket,
    sec: SecurityConfig,
    service: str,
    server_id: str,
    deadline_s: float = DEFAULT_DEADLINE_S,
    *,
    info: bytes = b"",
    accept: Accept | None = None,
) -> str:
    """Authenticate the client on ``sock``; returns its (proven) id."""
    hs = ServerHandshake(sec, service, server_id, info=info, accept=accept)
    return run_server(sock, hs, Deadline(deadline_s))


def client_handshake(
    sock: socket.socket,
    sec: SecurityConfig,
    service: str,
    client_id: str,
    deadline_s: float = DEFAULT_DEADLINE_S,
    *,
    info: bytes = b"",
    role: Role = CLIENT,
) -> str:
    """Authenticate to the server on ``sock`` as ``role`` ``client_id``; returns its id."""
    hs = ClientHandshake(sec, service, client_id, info=info, role=role)
    return run_client(sock, hs, Deadline(deadline_s))


# --- asyncio driver -------------------------------------------------------------------------


async def _awithin(coro: Coroutine[Any, Any, None], deadline_s: float) -> None:
    try:
        await asyncio.wait_for(coro, deadline_s)
    except TimeoutError as exc:
        if isinstance(exc, HandshakeTimeout):
            raise
        raise HandshakeTimeout(f"handshake did not complete within {deadline_s:g} s") from None


async def arun_server(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    hs: ServerHandshake,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> str:
    """asyncio twin of :func:`run_server` (one deadline for the whole exchange). Both skip
    the Challenge of an ``hs`` already started (its frame was sent by the accept path)."""
    if hs.peer_cert is None:
        hs.peer_cert = writer.get_extra_info("peercert") or None

    async def run() -> None:
        if not hs.started:  # else the accept path greeted (kvmesh.net.listener)
            writer.write(hs.start())
            await writer.drain()
        body = await aread_frame(reader, PREAUTH_MAX_FRAME)
        try:
            reply = hs.receive(body)
        except HandshakeError as exc:
            if exc.reply is not None:
                writer.write(exc.reply)
                with contextlib.suppress(OSError):
                    await writer.drain()
            raise
        writer.write(reply)
        await writer.drain()

    await _awithin(run(), deadline_s)
    return hs.peer_id  # type: ignore[return-value]


async def arun_client(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    hs: ClientHandshake,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> str:
    """asyncio twin of :func:`run_client`."""

    async def run() -> None:
        while not hs.done:
            out = hs.receive(await aread_frame(reader, PREAUTH_MAX_FRAME))
            if out is not None:
                writer.write(out)
                await writer.drain()

    await _awithin(run(), deadline_s)
    return hs.peer_id  # type: ignore[return-value]


async def aserver_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    sec: SecurityConfig,
    service: str,
    server_id: str,
    deadline_s: float = DEFAULT_DEADLINE_S,
    *,
    info: bytes = b"",
    accept: Accept | None = None,
) -> str:
    """asyncio twin of :func:`server_handshake`."""
    hs = ServerHandshake(sec, service, server_id, info=info, accept=accept)
    return await arun_server(reader, writer, hs, deadline_s)


async def aclient_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    sec: SecurityConfig,
    service: str,
    client_id: str,
    deadline_s: float = DEFAULT_DEADLINE_S,
    *,
    info: bytes = b"",
    role: Role = CLIENT,
) -> str:
    """asyncio twin of :func:`client_handshake`."""
    hs = ClientHandshake(sec, service, client_id, info=info, role=role)
    return await arun_client(reader, writer, hs, deadline_s)
