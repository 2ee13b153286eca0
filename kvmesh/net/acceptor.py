"""The accept path of the threaded kvmesh servers (the transfer engine's control port).

Such a server serves each authenticated connection in a thread of its own (blocking sockets
move bulk bytes fastest from Python), but a thread per *unauthenticated* connection would
let anyone without the token buy threads with connects. :class:`Acceptor` is one thread
that accepts, admits and authenticates every connection on non-blocking sockets with a
selector, and hands only authenticated ones to ``on_ready(sock, hs, slot)``:

* accepts in batches (:func:`~kvmesh.net.admission.accept_some`) and admits through the
  shared :class:`~kvmesh.net.admission.Gate` (the server's
  :class:`~kvmesh.net.limits.ConnectionLimiter`: per-source caps, eviction of the oldest
  stalled handshake, :data:`~kvmesh.net.limits.MIN_HANDSHAKE_AGE_S`; a first-come line per
  source), the one policy of docs/net.md, "Frames and limits";
* greets every connection with its Challenge at once, admitted or waiting: a peer's Hello
  arrives while it waits, and a waiting connection that answered goes ahead of its source's
  silent ones (``Gate.spoke``), so a silent flood from a peer's own address does not delay it;
* runs the sans-I/O :class:`~kvmesh.net.handshake.ServerHandshake` under one deadline per
  admitted connection (``deadline_s`` from admission), frames capped at
  :data:`~kvmesh.net.handshake.PREAUTH_MAX_FRAME`; refusals send the ``Refused`` frame;
* a pending connection costs a descriptor, a handshake object and at most 4 KiB of buffer.

No TLS: the threaded servers have none (docs/net.md, "Identity: who can speak as what").
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from .admission import POLL_S, Gate, accept_some, reset
from .errors import AuthFailed, FrameTooLarge, HandshakeError
from .framing import FrameDecoder
from .handshake import PREAUTH_MAX_FRAME, ServerHandshake
from .limits import ConnectionLimiter, Slot, source_of
from .throttle import LogThrottle

__all__ = ["Acceptor"]

log = logging.getLogger(__name__)

Ready = Callable[[socket.socket, ServerHandshake, Slot], None]


class _Conn:
    """One connection before its handshake completed."""

    __slots__ = ("acceptor", "deadline", "dec", "frame", "hs", "slot", "sock", "source")

    def __init__(self, acceptor: Acceptor, sock: socket.socket, source: str) -> None:
        self.acceptor = acceptor
        self.sock = sock
        self.source = source
        self.hs: ServerHandshake | None = None
        self.dec = FrameDecoder(PREAUTH_MAX_FRAME)
        self.frame: bytes | None = None  # the Hello, once read
        self.slot: Slot | None = None
        self.deadline = 0.0

    def evict(self) -> None:
        self.acceptor._forget(self)
        reset(self.sock)


class Acceptor:
    """Accept, admit and authenticate on ``lsock`` in one thread (module docstring).

    ``make_handshake()``: a fresh :class:`ServerHandshake` per connection. ``on_ready(sock,
    hs, slot)`` runs in the acceptor thread with the socket back in blocking mode and the
    slot already counted as authenticated; it owns both from then on (it must release the
    slot when the connection ends) and should only hand them to a worker."""

    def __init__(
        self,
        lsock: socket.socket,
        limiter: ConnectionLimiter,
        make_handshake: Callable[[], ServerHandshake],
        on_ready: Ready,
        *,
        deadline_s: float = 5.0,
        name: str = "kvmesh-accept",
    ) -> None:
        self.limiter = limiter
        self._lsock = lsock
        self._make = make_handshake
        self._on_ready = on_ready
        self.deadline_s = deadline_s
        self._throttle = LogThrottle(log, 5.0)
        self.gate = Gate(limiter, self._admitted, on_drop=self._unwatch)  # type: ignore[arg-type]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._shaking: dict[_Conn, None] = {}  # admitted, in their handshake, oldest first
        self._closed = False
        self._paused_until = 0.0
        self.accepted = 0
        self.authenticated = 0
        lsock.setblocking(False)
        self._sel.register(lsock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, False)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and close every pending connection (not the listening socket)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    # --- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._closed:
                try:
                    self._turn()
                except Exception:  # a bug must cost a connection, never the port
                    self._throttle.log(logging.ERROR, "bug", "acceptor turn failed", exc_info=True)
                    time.sleep(0.01)
        finally:
            self.gate.close()
            for c in list(self._shaking):
                self._fail(c)
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _turn(self) -> None:
        now = time.monotonic()
        timeout = 1.0
        if len(self.gate):
            timeout = POLL_S
        if self._shaking:
            timeout = min(timeout, max(0.0, next(iter(self._shaking)).deadline - now))
        if self._paused_until:
            timeout = min(timeout, max(0.0, self._paused_until - now))
        for key, _ in self._sel.select(timeout):
            if key.data is None:
                self._accept()
            elif key.data is False:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            else:
                self._readable(key.data)
        now = time.monotonic()
        if self._paused_until and now >= self._paused_until and not self._closed:
            self._paused_until = 0.0
            self._sel.register(self._lsock, selectors.EVENT_READ, None)
        self.gate.poll()
        while self._shaking:
            c = next(iter(self._shaking))
            if c.deadline > now:
                break
            self._fail(c)  # its handshake deadline passed

    def _accept(self) -> None:
        err = accept_some(self._lsock, self._accepted)
        if err is not None and not self._closed:
            # Out of descriptors: pause accepting a moment so closing connections free some.
            self._throttle.log(logging.WARNING, "accept", "acceptor: accept failed: %r", err)
            self._sel.unregister(self._lsock)
            self._paused_until = time.monotonic() + 0.05

    def _accepted(self, sock: socket.socket, addr: object) -> None:
        self.accepted += 1
        c = _Conn(self, sock, source_of(addr))
        try:
            sock.setblocking(False)
            c.hs = self._make()
            # The greeting first, admitted or not (module docstring); it fits a fresh
            # socket's send buffer, so a partial send means the peer is gone.
            frame = c.hs.start()
            if sock.send(frame) != len(frame):
                raise OSError("challenge not sent whole")
            self._sel.register(sock, selectors.EVENT_READ, c)
        except Exception as e:  # noqa: BLE001 - one connection, never the port
            reset(sock)
            if not isinstance(e, OSError):
                self._throttle.log(logging.WARNING, "admit", "acceptor: dropped one: %r", e)
            return
        self.gate.offer(c)

    def _admitted(self, c: _Conn, slot: Slot) -> None:
        c.slot = slot
        c.deadline = time.monotonic() + self.deadline_s
        self._shaking[c] = None
        if c.frame is not None:
            self._answer(c)

    def _readable(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(PREAUTH_MAX_FRAME + 4)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._fail(c)
            return
        try:
            frames = c.dec.feed(data)
        except FrameTooLarge:
            self._fail(c)
            return
        if frames:
            if c.frame is not None or len(frames) > 1 or c.dec.buffered:
                self._fail(c)  # nothing may follow the Hello before our Welcome
                return
            c.frame = frames[0]
        if c.slot is None:
            self.gate.spoke(c)
        elif c.frame is not None:
            self._answer(c)

    def _answer(self, c: _Conn) -> None:
        hs, frame = c.hs, c.frame
        assert hs is not None and frame is not None and c.slot is not None
        try:
            reply = hs.receive(frame)
        except HandshakeError as exc:
            if isinstance(exc, AuthFailed):
                self._throttle.log(
                    logging.WARNING, "auth", "refused a connection from %s: %s", c.source, exc
                )
            if exc.reply is not None:
                with contextlib.suppress(OSError):
                    c.sock.send(exc.reply)
            self._fail(c)
            return
        try:
            if c.sock.send(reply) != len(reply):
                raise OSError("welcome not sent whole")
        except OSError:
            self._fail(c)
            return
        slot = c.slot
        self._forget(c)
        if not self.limiter.authenticated(slot):
            reset(c.sock)
            return
        self.authenticated += 1
        try:
            c.sock.setblocking(True)
            self._on_ready(c.sock, hs, slot)
        except Exception as e:  # noqa: BLE001 - one connection, never the port
            self.limiter.release(slot)
            with contextlib.suppress(OSError):
                c.sock.close()
            self._throttle.log(logging.WARNING, "ready", "acceptor: dropped one: %r", e)

    # --- bookkeeping ----------------------------------------------------------------------
    def _unwatch(self, c: _Conn) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(c.sock)

    def _forget(self, c: _Conn) -> None:
        """Stop watching ``c`` (its slot, if any, is the caller's to release)."""
        self._unwatch(c)
        self._shaking.pop(c, None)
        self.gate.withdraw(c)

    def _fail(self, c: _Conn) -> None:
        self._forget(c)
        if c.slot is not None:
            self.limiter.release(c.slot)
        reset(c.sock)
