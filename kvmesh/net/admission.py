"""Admission of accepted connections: the part of the accept path every kvmesh server shares.

A server accepts in batches (:func:`accept_some`) and hands each bare socket to its
:class:`Gate`, which takes a slot of the server's
:class:`~kvmesh.net.limits.ConnectionLimiter` for it (per-source caps, eviction of the
oldest stalled handshake, minimum handshake age) or, when none can be had now, puts it in
its source's line. Lines are first come, first served: a waiting connection is admitted
(``admit(conn, slot)``) as soon as its source can have a slot again -- a handshake of that
source ended, or its oldest one reached the minimum age -- and a newcomer from a source
that has a line queues behind it.

Why a line and not a refusal: a flood that reconnects the moment it is refused or evicted
(most do) otherwise turns every refusal into a retry, and each slot its source frees goes
to whoever asks first -- almost always the flood's own reconnect, so an honest peer on the
flood's address got in 30-39 times of 40 (docs/net.md, "Connect floods"). In line, the
flood's reconnects queue behind the peer, which waits at most (connections the source has
waiting) / (per-source cap / minimum age) -- about 0.6 s for 100 silent connections at a
32-handshake cap -- whatever the machine's speed; a server that greets waiting connections
(:meth:`Gate.spoke`) lets one that answered go first, and then it waits at most about one
minimum age. A waiting connection costs one descriptor and no transport, thread or buffer;
at most ``max_waiting`` wait (the source with the most waiting gives up its oldest silent
one when more come) for at most ``wait_s``, and one whose peer has gone already is dropped
before it is admitted.

:class:`Gate` does no I/O of its own beyond closing sockets it drops and reads no clock
but the one it is given; it is not thread-safe (one accept loop or thread owns it).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import struct
import time
from collections.abc import Callable
from typing import Protocol

from .limits import ConnectionLimiter, Slot
from .throttle import LogThrottle

__all__ = ["ACCEPT_BATCH", "POLL_S", "Gate", "Pending", "accept_some", "reset"]

# Connections accepted per readiness event: enough to keep up with a flood between two
# loop iterations, few enough that the loop's other work (raft, clients) keeps its turn.
ACCEPT_BATCH = 512
# How often a gate with waiting connections retries them: a slot frees when a handshake
# ends or its source's oldest reaches the minimum age (0.25 s); a few ms late is harmless.
POLL_S = 0.01
_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close with a reset, no TIME_WAIT
# accept() errors that concern only the connection being accepted
_TRANSIENT = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ENETDOWN, errno.EHOSTUNREACH}

log = logging.getLogger(__name__)
_throttle = LogThrottle(log, 5.0)


def reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (no TIME_WAIT left behind)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
    sock.close()


def accept_some(
    lsock: socket.socket,
    on_accepted: Callable[[socket.socket, object], None],
    batch: int = ACCEPT_BATCH,
) -> OSError | None:
    """Accept up to ``batch`` connections from the non-blocking ``lsock``, each passed to
    ``on_accepted(sock, addr)`` (which owns it from then on). Returns the error that should
    pause accepting a moment (EMFILE, ENFILE, ENOBUFS: closing connections free descriptors;
    a readiness loop would spin on it), else None."""
    for _ in range(batch):
        try:
            sock, addr = lsock.accept()
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as e:
            if e.errno in _TRANSIENT:
                continue
            return e
        on_accepted(sock, addr)
    return None


class Pending(Protocol):
    """An accepted connection on its way through a :class:`Gate`."""

    sock: socket.socket
    source: str  # kvmesh.net.limits.source_of its peer address

    def evict(self) -> None:
        """Close it: a newer connection takes its slot while it is unauthenticated."""


def _gone(sock: socket.socket) -> bool:
    """The peer closed or reset ``sock`` while it waited (nothing is consumed)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


class _Line:
    """One source's waiting connections, oldest first: those that already spoke (sent a
    byte, e.g. their Hello after an early Challenge) ahead of those still silent."""

    __slots__ = ("silent", "spoke")

    def __init__(self) -> None:
        self.silent: dict[Pending, float] = {}
        self.spoke: dict[Pending, float] = {}

    def __len__(self) -> int:
        return len(self.silent) + len(self.spoke)

    def head(self) -> tuple[Pending, float]:
        d = self.spoke or self.silent
        conn = next(iter(d))
        return conn, d[conn]

    def remove(self, conn: Pending) -> None:
        if self.spoke.pop(conn, None) is None:
            del self.silent[conn]


class Gate:
    """A slot of ``limiter`` for each connection offered, now or in its turn (module
    docstring); ``admit(conn, slot)`` gets the admitted ones and owns them from then on
    (it must release the slot when the connection ends).

    A server that greets waiting connections (sends them its Challenge while they wait, as
    the transfer control port does) calls :meth:`spoke` when one answers: it goes ahead of
    its source's silent ones. A flood that stays silent then never delays a peer that
    answers, however many connections it holds; one that sends bytes only shares the line.
    """

    def __init__(
        self,
        limiter: ConnectionLimiter,
        admit: Callable[[Pending, Slot], None],
        *,
        max_waiting: int = 256,
        wait_s: float = 2.0,
        on_drop: Callable[[Pending], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_waiting < 1 or wait_s <= 0:
            raise ValueError("max_waiting must be >= 1 and wait_s > 0")
        self.limiter = limiter
        self._admit = admit
        self._on_drop = on_drop
        self.max_waiting = max_waiting
        self.wait_s = wait_s
        self._clock = clock
        self._lines: dict[str, _Line] = {}
        self._where: dict[Pending, str] = {}  # waiting connection -> its source
        self.queued = 0  # connections that had to wait (stats and tests)
        self.dropped = 0  # closed without a slot: line full, waited too long, peer gone

    def __len__(self) -> int:
        """Connections waiting now."""
        return len(self._where)

    def waiting(self, conn: Pending) -> bool:
        return conn in self._where

    def withdraw(self, conn: Pending) -> None:
        """Forget ``conn`` if it waits (its server closed it); the socket is the caller's."""
        if conn in self._where:
            self._remove(conn)

    def offer(self, conn: Pending) -> bool:
        """A newly accepted connection: admitted now (True), or queued behind its source's
        line (False; it may also have been dropped, the line being full)."""
        if conn.source not in self._lines:
            slot = self.limiter.try_acquire(on_evict=conn.evict, source=conn.source)
            if slot is not None:
                self._give(conn, slot)
                return True
        self._enqueue(conn)
        return False

    def spoke(self, conn: Pending) -> None:
        """``conn`` (waiting) sent something: it goes ahead of its source's silent ones."""
        source = self._where.get(conn)
        if source is None:
            return
        line = self._lines[source]
        t = line.silent.pop(conn, None)
        if t is not None:
            line.spoke[conn] = t

    def _enqueue(self, conn: Pending) -> None:
        if len(self._where) >= self.max_waiting:
            # The source with the most waiting gives up its oldest silent one: it had the
            # longest chance to answer a greeting (or, ungreeted, to be served), and under a
            # connect flood the oldest are the ones whose peer has most likely gone.
            heavy = max(self._lines, key=lambda s: len(self._lines[s]))
            line = self._lines[heavy]
            if not line.silent:
                self._drop(conn)
                return
            victim = next(iter(line.silent))
            self._remove(victim)
            self._drop(victim)
        self._lines.setdefault(conn.source, _Line()).silent[conn] = self._clock()
        self._where[conn] = conn.source
        self.queued += 1

    def _remove(self, conn: Pending) -> None:
        source = self._where.pop(conn)
        line = self._lines[source]
        line.remove(conn)
        if not line:
            del self._lines[source]

    def _give(self, conn: Pending, slot: Slot) -> None:
        try:
            self._admit(conn, slot)
        except Exception as e:  # noqa: BLE001 - one connection, never the port
            self.limiter.release(slot)
            reset(conn.sock)
            _throttle.log(logging.WARNING, "admit", "admission: dropped one: %r", e)

    def _drop(self, conn: Pending) -> None:
        self.dropped += 1
        if self._on_drop is not None:
            self._on_drop(conn)
        reset(conn.sock)

    def poll(self) -> bool:
        """Admit the waiting connections whose turn has come and drop those that waited too
        long or whose peer is gone; True while any still wait (poll again in ``POLL_S``)."""
        if not self._where:
            return False
        stale = self._clock() - self.wait_s
        lim = self.limiter
        for source in list(self._lines):
            line = self._lines[source]
            while source in self._lines:
                conn, t = line.head()
                if t <= stale or (conn in line.silent and _gone(conn.sock)):
                    self._remove(conn)
                    self._drop(conn)
                    continue
                slot = lim.try_acquire(on_evict=conn.evict, source=source)
                if slot is None:
                    break  # its source has no slot yet; the rest of its line neither
                self._remove(conn)
                self._give(conn, slot)
        return bool(self._where)

    def close(self) -> None:
        """Drop every waiting connection."""
        for conn in list(self._where):
            self._remove(conn)
            self._drop(conn)
