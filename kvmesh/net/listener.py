"""The accept path of every kvmesh asyncio server (replog peer and client ports, store master).

``asyncio.start_server`` builds a transport, a protocol, a stream pair and a task for every
connection it accepts, and accepts at most ``backlog`` (100) per loop iteration: under a
connect flood it drains ~1,300 connections a second, the kernel's accept queue stays full
and the SYNs of real peers are dropped before any admission policy sees them
(docs/net.md, "Connect floods"). :func:`start_listener` accepts on the listening socket
itself, in a tight loop on the event loop, and passes the bare socket through the
admission every server shares (:class:`kvmesh.net.admission.Gate`: the server's
:class:`~kvmesh.net.limits.ConnectionLimiter` -- per-source caps, eviction, minimum age --
and a first-come line per source): a connection that must wait costs a descriptor, and
only an admitted one becomes a transport and a handler task. It runs on the loop thread
(not an accept thread) so that it never waits for the GIL behind a busy loop and the
limiter's eviction can abort a transport directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl as _ssl
from collections.abc import Awaitable, Callable

from .addr import family_of
from .admission import ACCEPT_BATCH, POLL_S, Gate, accept_some, reset
from .handshake import ServerHandshake
from .limits import ConnectionLimiter, Slot, source_of
from .throttle import LogThrottle

__all__ = ["ACCEPT_BATCH", "Listener", "start_listener"]

log = logging.getLogger(__name__)

BACKLOG = 4096  # the kernel caps it at net.core.somaxconn

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, Slot], Awaitable[None]]


class _Accepted:
    """One admitted connection on its way to becoming a transport."""

    __slots__ = ("evicted", "hs", "sock", "source", "transport", "watching")

    def __init__(self, sock: socket.socket, source: str) -> None:
        self.sock = sock
        self.source = source
        self.transport: asyncio.BaseTransport | None = None
        self.evicted = False
        self.hs: ServerHandshake | None = None  # greeted: its Challenge is sent
        self.watching = False  # waiting, with a reader that tells the gate it spoke

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
    releases ``slot`` when it ends (``limiter.authenticated(slot)`` after its handshake).

    ``greet`` (without TLS only): a fresh :class:`ServerHandshake` for each accepted
    connection, whose Challenge is sent at once, admitted or waiting; a waiting one that
    answers goes ahead of its source's silent ones (``Gate.spoke``: a silent flood from a
    peer's own address then never delays it), and the handler finds the begun handshake in
    ``slot.handshake`` (drive it with ``arun_server``, which skips the Challenge)."""

    def __init__(
        self,
        sock: socket.socket,
        handler: Handler,
        limiter: ConnectionLimiter,
        *,
        ssl: _ssl.SSLContext | None = None,
        ssl_handshake_timeout: float | None = None,
        limit: int = 1 << 16,
        greet: Callable[[], ServerHandshake] | None = None,
    ) -> None:
        self._sock = sock
        self._greet = greet if ssl is None else None  # under TLS the Challenge waits for it
        self._handler = handler
        self.limiter = limiter
        self._ssl = ssl
        self._ssl_timeout = ssl_handshake_timeout if ssl is not None else None
        self._limit = limit
        self._loop = asyncio.get_running_loop()
        self._throttle = LogThrottle(log, 5.0)
        self._pending: set[asyncio.Task] = set()
        self.gate = Gate(limiter, self._admitted, on_drop=self._unwatch)  # type: ignore[arg-type]
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False
        self.accepted = 0
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
        self.gate.close()
        if self._sweep is not None:
            self._sweep.cancel()
        for t in list(self._pending):
            t.cancel()

    def _on_readable(self) -> None:
        err = accept_some(self._sock, self._accepted)
        if err is not None and not self._closed:
            self._throttle.log(logging.WARNING, "accept", "listener: accept failed: %r", err)
            self._loop.remove_reader(self._sock.fileno())
            self._loop.call_later(0.05, self._resume)
        self._poll()

    def _poll(self) -> None:
        # Waiting connections are retried after every accept batch and, while any wait,
        # every POLL_S (one timer at a time).
        if self.gate.poll() and not self._closed and self._sweep is None:
            self._sweep = self._loop.call_later(POLL_S, self._on_sweep)

    def _on_sweep(self) -> None:
        self._sweep = None
        self._poll()

    def _resume(self) -> None:
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._on_readable)

    def _accepted(self, sock: socket.socket, addr: object) -> None:
        self.accepted += 1
        conn = _Accepted(sock, source_of(addr))
        try:
            sock.setblocking(False)
            if self._greet is not None:
                conn.hs = self._greet()
                frame = conn.hs.start()
                # A fresh socket's send buffer takes it whole; short means the peer is gone.
                if sock.send(frame) != len(frame):
                    raise ConnectionError("challenge not sent whole")
        except OSError:
            reset(sock)
            return
        except Exception as e:  # noqa: BLE001 - one connection, never the port
            reset(sock)
            self._throttle.log(logging.WARNING, "admit", "listener: dropped one: %r", e)
            return
        if not self.gate.offer(conn) and conn.hs is not None and self.gate.waiting(conn):
            conn.watching = True
            self._loop.add_reader(sock.fileno(), self._spoke, conn)

    def _spoke(self, conn: _Accepted) -> None:
        self._unwatch(conn)
        self.gate.spoke(conn)

    def _unwatch(self, conn: _Accepted) -> None:
        if conn.watching:
            conn.watching = False
            self._loop.remove_reader(conn.sock.fileno())

    def _admitted(self, conn: _Accepted, slot: Slot) -> None:
        self._unwatch(conn)
        slot.handshake = conn.hs
        t = self._loop.create_task(self._connect(conn, slot))
        self._pending.add(t)
        t.add_done_callback(self._pending.discard)

    async def _connect(self, conn: _Accepted, slot: Slot) -> None:
        if conn.evicted:
            reset(conn.sock)
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
    greet: Callable[[], ServerHandshake] | None = None,
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
            greet=greet,
        )
    except BaseException:
        sock.close()
        raise
