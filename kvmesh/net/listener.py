"""The accept path of every kvmesh asyncio server (replog peer and client ports, store master).

``asyncio.start_server`` builds a transport, a protocol, a stream pair and a task for every
connection it accepts, and accepts at most ``backlog`` (100) per loop iteration: under a
connect flood it drains ~1,300 connections a second, the kernel's accept queue stays full
and the SYNs of real peers are dropped before any admission policy sees them
(docs/net.md, "Connect floods"). :func:`start_listener` accepts on the listening socket
itself, in a tight loop on the event loop, and applies the server's
:class:`~kvmesh.net.limits.ConnectionLimiter` (per-source caps, eviction, minimum age) to
the bare socket: a refused connection costs an ``accept`` and a reset, a few microseconds,
and only an admitted one becomes a transport and a handler task. It runs on the loop thread
(not an accept thread) so that it never waits for the GIL behind a busy loop and the
limiter's eviction can abort a transport directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import random
import socket
import ssl as _ssl
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable

from .addr import family_of
from .limits import ConnectionLimiter, Slot, source_of
from .throttle import LogThrottle

__all__ = ["ACCEPT_BATCH", "Listener", "Tarpit", "start_listener"]

log = logging.getLogger(__name__)

# Connections accepted per readiness callback: enough to keep up with a flood between two
# loop iterations, few enough that the loop's other callbacks (raft, clients) keep their turn.
ACCEPT_BATCH = 512
BACKLOG = 4096  # the kernel caps it at net.core.somaxconn
_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close with a reset, no TIME_WAIT
# accept() errors that concern only the connection being accepted
_TRANSIENT = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ENETDOWN, errno.EHOSTUNREACH}

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, Slot], Awaitable[None]]


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
    sock.close()


class Tarpit:
    """Refused connections, held unread (no transport, one descriptor each) for up to
    ``hold_s`` and at most ``max_held`` of them (the oldest is reset first).

    Most floods reconnect the moment they are refused: reset at once, a flood from an honest
    peer's own address would spin on refusals and take every handshake that address gets
    (docs/net.md, "Connect floods"). Held, the flood waits as if its handshake were in
    progress, and the peer finds a slot. Not thread-safe: one
    accept loop owns it."""

    def __init__(self, max_held: int = 256, hold_s: float = 1.0) -> None:
        self.max_held = max_held
        self.hold_s = hold_s
        self._held: deque[tuple[float, socket.socket]] = deque()

    def hold(self, sock: socket.socket, now: float) -> None:
        # Jittered (0.5-1.5 x hold_s): connections refused together must not come back
        # together and take their source's next handshakes in one burst.
        self._held.append((now + self.hold_s * (0.5 + random.random()), sock))
        while len(self._held) > self.max_held:
            _reset(self._held.popleft()[1])

    def expire(self, now: float) -> None:
        # Oldest first; a later one whose jitter ran out waits for those held before it.
        held = self._held
        while held and held[0][0] <= now:
            _reset(held.popleft()[1])

    def __len__(self) -> int:
        return len(self._held)

    def close(self) -> None:
        while self._held:
            _reset(self._held.popleft()[1])


class _Accepted:
    """One admitted connection on its way to becoming a transport."""

    __slots__ = ("evicted", "sock", "transport")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.transport: asyncio.BaseTransport | None = None
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True
        if self.transport is not None:
            self.transport.abort()
        else:
            # Still in connect_accepted_socket (or its TLS handshake): end it early; the
            # handler is never started (_connected).
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)


class Listener:
    """A listening socket whose connections pass ``limiter`` before they cost a transport
    (module docstring). ``handler(reader, writer, slot)`` serves an admitted connection and
    releases ``slot`` when it ends (``limiter.authenticated(slot)`` after its handshake)."""

    def __init__(
        self,
        sock: socket.socket,
        handler: Handler,
        limiter: ConnectionLimiter,
        *,
        ssl: _ssl.SSLContext | None = None,
        ssl_handshake_timeout: float | None = None,
        limit: int = 1 << 16,
    ) -> None:
        self._sock = sock
        self._handler = handler
        self.limiter = limiter
        self._ssl = ssl
        self._ssl_timeout = ssl_handshake_timeout if ssl is not None else None
        self._limit = limit
        self._loop = asyncio.get_running_loop()
        self._throttle = LogThrottle(log, 5.0)
        self._pending: set[asyncio.Task] = set()
        self._tarpit = Tarpit()
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False
        self.accepted = 0
        self.refused = 0  # closed at accept by the limiter
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._on_readable)

    @property
    def sockets(self) -> list[socket.socket]:
        return [] if self._closed else [self._sock]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._tarpit.close()
        if self._sweep is not None:
            self._sweep.cancel()
        for t in list(self._pending):
            t.cancel()

    def _on_readable(self) -> None:
        try:
            self._accept_batch()
        finally:
            self._tarpit.expire(time.monotonic())
            if len(self._tarpit) and self._sweep is None and not self._closed:
                self._sweep = self._loop.call_later(self._tarpit.hold_s / 2, self._expire)

    def _expire(self) -> None:
        self._sweep = None
        self._tarpit.expire(time.monotonic())
        if len(self._tarpit) and not self._closed:
            self._sweep = self._loop.call_later(self._tarpit.hold_s / 2, self._expire)

    def _accept_batch(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if self._closed:
                    return
                if e.errno in _TRANSIENT:
                    continue
                # EMFILE/ENFILE/ENOBUFS: stop accepting a moment so closing connections free
                # descriptors (a readiness callback would otherwise spin on the error).
                self._throttle.log(logging.WARNING, "accept", "listener: accept failed: %r", e)
                self._loop.remove_reader(self._sock.fileno())
                self._loop.call_later(0.05, self._resume)
                return
            self.accepted += 1
            try:
                self._admit(sock, addr)
            except Exception as e:  # noqa: BLE001 - one connection, never the port
                _reset(sock)
                self._throttle.log(logging.WARNING, "admit", "listener: dropped one: %r", e)

    def _resume(self) -> None:
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._on_readable)

    def _admit(self, sock: socket.socket, addr: object) -> None:
        conn = _Accepted(sock)
        slot = self.limiter.try_acquire(on_evict=conn.evict, source=source_of(addr))
        if slot is None:
            self.refused += 1
            self._tarpit.hold(sock, time.monotonic())
            return
        sock.setblocking(False)
        t = self._loop.create_task(self._connect(conn, slot))
        self._pending.add(t)
        t.add_done_callback(self._pending.discard)

    async def _connect(self, conn: _Accepted, slot: Slot) -> None:
        if conn.evicted:
            _reset(conn.sock)
            return
        loop = self._loop

        def protocol() -> asyncio.StreamReaderProtocol:
            reader = asyncio.StreamReader(limit=self._limit, loop=loop)
            cb = functools.partial(self._connected, conn, slot)
            return asyncio.StreamReaderProtocol(reader, cb, loop=loop)

        try:
            await loop.connect_accepted_socket(
                protocol, conn.sock, ssl=self._ssl, ssl_handshake_timeout=self._ssl_timeout
            )
        except (OSError, EOFError, TimeoutError, asyncio.CancelledError, _ssl.SSLError):
            # A peer that reset, failed TLS or was evicted meanwhile; the slot is free again.
            self.limiter.release(slot)
            with contextlib.suppress(OSError):
                conn.sock.close()
        except Exception as e:  # noqa: BLE001 - e.g. uvloop's RuntimeError on a closed handle
            self.limiter.release(slot)
            with contextlib.suppress(OSError):
                conn.sock.close()
            self._throttle.log(logging.WARNING, "connect", "listener: dropped one: %r", e)

    def _connected(
        self,
        conn: _Accepted,
        slot: Slot,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> Awaitable[None] | None:
        # Called from the protocol's connection_made: from here on eviction aborts it.
        conn.transport = writer.transport
        if conn.evicted or self._closed:
            writer.transport.abort()
            self.limiter.release(slot)
            return None
        return self._handler(reader, writer, slot)


async def start_listener(
    handler: Handler,
    host: str,
    port: int,
    limiter: ConnectionLimiter,
    *,
    ssl: _ssl.SSLContext | None = None,
    ssl_handshake_timeout: float | None = None,
    limit: int = 1 << 16,
    backlog: int = BACKLOG,
) -> Listener:
    """Listen on ``host:port`` (the family :func:`~kvmesh.net.addr.family_of` picks;
    SO_REUSEADDR) and serve admitted connections with ``handler`` (:class:`Listener`)."""
    sock = socket.create_server((host, port), family=family_of(host), backlog=backlog)
    try:
        return Listener(
            sock,
            handler,
            limiter,
            ssl=ssl,
            ssl_handshake_timeout=ssl_handshake_timeout,
            limit=limit,
        )
    except BaseException:
        sock.close()
        raise
