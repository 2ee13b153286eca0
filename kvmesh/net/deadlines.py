"""Deadlines of a listener's asyncio connections, enforced by one sweeper task.

Shared by the replicated log's listener and the store master (one mechanism): a per-read
``asyncio.timeout`` cost ~10 % of a replog leader's CPU on small requests and two of them
~15 us of a store master's single-key lookup under uvloop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .framing import FrameDecoder

__all__ = ["TURN_REQUESTS", "DeadlineWatch", "Watched", "read_frames"]

_READ = 256 << 10


class Watched:
    """A connection under a :class:`DeadlineWatch`: its reads report progress here."""

    __slots__ = ("writer", "dec", "last", "started", "busy", "expired", "paused_at")

    def __init__(
        self,
        writer: asyncio.StreamWriter,
        dec: FrameDecoder,
        busy: Callable[[], bool] | None,
        now: float,
    ) -> None:
        self.writer = writer
        self.dec = dec
        self.last = now  # last time bytes arrived
        self.started = 0.0  # when the frame being received began (0: none)
        self.busy = busy  # a connection waiting for its own answers is not idle
        self.expired = ""
        self.paused_at = 0.0  # the server itself stopped reading at (0: it reads)

    def pause(self) -> None:
        """The server stops reading this connection for reasons of its own (its in-flight
        limit is full): that time counts toward neither deadline."""
        if not self.paused_at:
            self.paused_at = asyncio.get_running_loop().time()

    def resume(self) -> None:
        """Reading again: both clocks move on by the time spent paused."""
        if self.paused_at:
            held = asyncio.get_running_loop().time() - self.paused_at
            self.paused_at = 0.0
            self.last += held
            if self.started:
                self.started += held


class DeadlineWatch:
    """Idle and frame deadlines of one listener's connections, enforced by one sweeper
    task instead of a timer per read (a per-read ``asyncio.timeout`` cost ~10 % of a
    leader's CPU on small requests). A connection without a frame in progress is closed
    after ``idle_s`` without bytes (unless ``busy()``); one whose frame started more than
    ``frame_s`` ago is closed, however slowly its bytes trickle. Deadlines are checked every
    ``min(idle_s, frame_s) / 4``, so they hold to within that."""

    def __init__(self, idle_s: float, frame_s: float) -> None:
        self.idle_s = idle_s
        self.frame_s = frame_s
        self._conns: dict[asyncio.StreamWriter, Watched] = {}
        self._task: asyncio.Task | None = None
        self.expired = 0

    def watch(
        self,
        writer: asyncio.StreamWriter,
        dec: FrameDecoder,
        busy: Callable[[], bool] | None = None,
    ) -> Watched:
        loop = asyncio.get_running_loop()
        w = Watched(writer, dec, busy, loop.time())
        self._conns[writer] = w
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._sweep(), name="kvmesh-deadlines")
        return w

    def unwatch(self, w: Watched) -> None:
        self._conns.pop(w.writer, None)

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        period = max(0.01, min(self.idle_s, self.frame_s) / 4)
        while self._conns:
            await asyncio.sleep(period)
            now = loop.time()
            for w in list(self._conns.values()):
                if w.paused_at:
                    continue  # the server, not the peer, is holding this connection
                if w.dec.buffered:
                    if not w.started:
                        w.started = w.last
                    if now - w.started > self.frame_s:
                        w.expired = f"a frame did not complete within {self.frame_s:g} s"
                elif now - w.last > self.idle_s and not (w.busy is not None and w.busy()):
                    w.expired = f"idle for more than {self.idle_s:g} s"
                if w.expired:
                    self.expired += 1
                    self._conns.pop(w.writer, None)
                    w.writer.transport.abort()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


TURN_REQUESTS = 16
"""Requests a server's read loop answers from one connection before it lets the event loop
run others (``await asyncio.sleep(0)``): one read of up to 256 KiB can hold tens of thousands
of tiny frames, and answering them all without a suspension stalls every other connection of
the server for a pipelining peer (~0.5 s per read measured on both the store master and the
log's client port)."""


async def read_frames(
    reader: asyncio.StreamReader,
    w: Watched,
    on_buffered: Callable[[int], None] | None = None,
) -> list[bytes]:
    """The next complete frame bodies from ``reader`` (decoded by ``w.dec``), reporting
    progress to ``w``'s :class:`DeadlineWatch`. Raises ``TimeoutError`` once the watch
    closed the connection for a deadline, ``asyncio.IncompleteReadError`` at EOF,
    ``FrameTooLarge``. ``on_buffered(n)`` is told how many bytes of an incomplete frame the
    decoder holds after each read (it may raise to refuse them: a server-wide budget)."""
    dec = w.dec
    loop = asyncio.get_running_loop()
    while True:
        try:
            data = await reader.read(_READ)
        except (ConnectionError, OSError):
            if w.expired:
                raise TimeoutError(w.expired) from None
            raise
        if not data:
            if w.expired:
                raise TimeoutError(w.expired)
            raise asyncio.IncompleteReadError(b"", None)
        now = loop.time()
        w.last = now
        out = dec.feed(data)
        if dec.buffered:
            if out or not w.started:
                w.started = now  # the frame in progress began in this read
        else:
            w.started = 0.0
        if out:
            return out
        if on_buffered is not None:
            on_buffered(dec.buffered)
