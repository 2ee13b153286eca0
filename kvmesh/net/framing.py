"""Length-prefixed frames: a 4-byte little-endian body length, then the body.

The limit on a frame is given per call (per server and per connection state: a connection
that has not authenticated yet is held to :data:`~kvmesh.net.handshake.PREAUTH_MAX_FRAME`).
A length prefix above the limit raises :class:`FrameTooLarge` before anything is allocated,
and below it buffers still grow only as bytes arrive (at most doubling what has arrived, plus
:data:`CHUNK`), so a peer that announces a large frame and then trickles costs what it sent.

* :class:`FrameDecoder` is the sans-I/O core (feed bytes, get frame bodies).
* :func:`read_frame` / :func:`send_frame` drive a blocking socket under an optional
  :class:`~kvmesh.net.limits.Deadline`. ``read_frame`` never reads past the end of its frame,
  so raw payload bytes that follow a frame (the transfer engine's data path) stay in the socket.
  Its ``spin`` (seconds, see :func:`spin_budget`) first polls the socket without blocking for
  that long before it blocks: a request/reply client whose peer answers within tens of
  microseconds then skips the scheduler wake-up a blocking ``recv`` costs (~25-30 us per
  side of a round trip on a quiet VM). Between polls it yields the CPU (``sched_yield``),
  so a peer waiting for the same CPU runs at once instead of after the budget.
* :func:`aread_frame` is the asyncio driver (bound it with ``asyncio.wait_for``; its
  ``frame_timeout`` bounds the body of a frame once its length prefix arrived).
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct
import time

from .errors import DeadlineExceeded, FrameTooLarge, PeerClosed
from .limits import Deadline

HEADER = struct.Struct("<I")
CHUNK = 64 << 10  # buffers grow by at most this much (or by what already arrived) per step

SPIN_ENV = "KVMESH_SPIN_US"
DEFAULT_SPIN_US = 100.0
"""Default busy-poll budget of a request/reply client (``KVMESH_SPIN_US`` overrides it; 0
turns it off). Measured on our 2-core VM (docs/store.md, "Performance and tuning"): when the
machine is quiet, a blocking wait pays the VM's wake-up of an idle CPU on both sides and a
one-key master round trip took 130-170 us; spinning 100 us brought it to 45-80 us (50 us
was too short for GetReplicas). When the machine is busy it neither helped nor hurt the
latency (the yield between polls lets the master run), at up to the budget in CPU."""
MAX_SPIN_US = 10_000.0  # a budget beyond this is a configuration error, not a tuning choice

_yield = getattr(os, "sched_yield", lambda: None)
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


def spin_budget(spin_us: float | None = None) -> float:
    """The busy-poll budget in seconds: ``spin_us`` if given, else ``$KVMESH_SPIN_US``, else
    :data:`DEFAULT_SPIN_US`. Raises ``ValueError`` outside ``0..MAX_SPIN_US``."""
    if spin_us is None:
        raw = os.environ.get(SPIN_ENV, "").strip()
        try:
            spin_us = float(raw) if raw else DEFAULT_SPIN_US
        except ValueError:
            raise ValueError(f"{SPIN_ENV}={raw!r} is not a number of microseconds") from None
    if not 0.0 <= spin_us <= MAX_SPIN_US:  # also refuses NaN
        raise ValueError(f"spin budget must be 0..{MAX_SPIN_US:g} us, got {spin_us!r}")
    return spin_us / 1e6


def encode_frame(body: bytes | bytearray | memoryview) -> bytes:
    """``len(body)`` as 4 little-endian bytes, then ``body``."""
    return HEADER.pack(len(body)) + bytes(body)


def _too_large(size: int, max_frame: int) -> FrameTooLarge:
    return FrameTooLarge(f"peer announced a frame of {size} bytes; the limit is {max_frame}")


class FrameDecoder:
    """Sans-I/O frame splitter: ``feed(data)`` returns the bodies completed by ``data``.

    Holds only bytes that arrived; raises :class:`FrameTooLarge` as soon as a length prefix
    above ``max_frame`` is seen (the connection is then unusable: close it).
    """

    __slots__ = ("_buf", "_need", "max_frame")

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._need = -1  # body length of the frame being read; -1 while reading a header

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        self._buf += data
        out: list[bytes] = []
        buf = self._buf
        pos = 0
        while True:
            if self._need < 0:
                if len(buf) - pos < HEADER.size:
                    break
                (size,) = HEADER.unpack_from(buf, pos)
                if size > self.max_frame:
                    self._buf = bytearray()
                    raise _too_large(size, self.max_frame)
                self._need = size
                pos += HEADER.size
            if len(buf) - pos < self._need:
                break
            out.append(bytes(buf[pos : pos + self._need]))
            pos += self._need
            self._need = -1
        if pos:
            del buf[:pos]
        return out

    @property
    def buffered(self) -> int:
        """Bytes held for the frame in progress."""
        return len(self._buf)


def _recv_into(sock: socket.socket, view: memoryview, deadline: Deadline | None) -> None:
    while len(view):
        if deadline is not None:
            sock.settimeout(deadline.check("receiving a frame"))
        try:
            n = sock.recv_into(view)
        except TimeoutError:
            if deadline is not None:
                raise DeadlineExceeded(
                    f"receiving a frame passed its {deadline.seconds:g} s deadline"
                ) from None
            raise
        if n == 0:
            raise PeerClosed("peer closed the connection")
        view = view[n:]


def _spin_recv_into(
    sock: socket.socket, view: memoryview, spin: float, deadline: Deadline | None
) -> int:
    """Poll ``sock`` (already non-blocking) with ``recv_into(view)`` for at most ``spin``
    seconds (and never past ``deadline``); the bytes received, 0 if none arrived in time.
    Each poll is one syscall with the GIL released, so other threads run meanwhile. TLS: a
    non-blocking read also returns bytes the TLS layer already decrypted (``pending()``),
    and a record that is only partly in raises ``SSLWantReadError`` like an empty socket."""
    end = time.perf_counter() + spin
    if deadline is not None:
        end = min(end, time.perf_counter() + deadline.remaining())
    while True:
        try:
            n = sock.recv_into(view)
        except _WOULD_BLOCK:
            if time.perf_counter() >= end:
                return 0
            # Let a peer that shares our CPU (the server we wait for, on a small box)
            # run now instead of when our budget ends; returns at once on an idle CPU.
            _yield()
            continue
        if n == 0:
            raise PeerClosed("peer closed the connection")
        return n


def _ready_into(sock: socket.socket, view: memoryview) -> int:
    """Read what has arrived into ``view`` from a non-blocking ``sock``, never waiting."""
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except _WOULD_BLOCK:
            break
        if n == 0:
            raise PeerClosed("peer closed the connection")
        got += n
    return got


def read_frame(
    sock: socket.socket,
    max_frame: int,
    deadline: Deadline | None = None,
    *,
    spin: float = 0.0,
) -> bytearray:
    """Read exactly one frame from a blocking socket and return its body.

    With ``deadline`` every ``recv`` gets only the time left (one absolute bound for the whole
    frame, however slowly the peer trickles); without it the socket's own timeout applies.
    ``spin``: seconds to busy-poll for the frame's first bytes before blocking (0: block at
    once); it never extends the deadline, and the CPU it can burn per call is bounded by it.
    Once the length prefix arrived while polling, the part of the body already here is read
    in the same non-blocking mode (a small reply arrives whole: no second timeout switch
    and ``poll``), and the socket's timeout is restored before any blocking read.
    Raises :class:`FrameTooLarge`, :class:`PeerClosed` (EOF), :class:`DeadlineExceeded`,
    ``TimeoutError`` (socket timeout, no deadline) or ``OSError``.
    """
    head = bytearray(HEADER.size)
    hv = memoryview(head)
    body: bytearray | None = None
    bv: memoryview | None = None
    if spin > 0.0:
        timeout = sock.gettimeout()
        sock.settimeout(0.0)
        try:
            got = _spin_recv_into(sock, hv, spin, deadline)
            hv = hv[got:]
            if got and len(hv):  # a split length prefix: take what followed it
                hv = hv[_ready_into(sock, hv) :]
            if not len(hv):
                (size,) = HEADER.unpack(head)
                if size > max_frame:
                    raise _too_large(size, max_frame)
                if size <= CHUNK:
                    body = bytearray(size)
                    bv = memoryview(body)
                    bv = bv[_ready_into(sock, bv) :]
        finally:
            sock.settimeout(timeout)
    if body is not None and bv is not None:
        _recv_into(sock, bv, deadline)  # returns at once when the body is all here
        return body
    _recv_into(sock, hv, deadline)
    (size,) = HEADER.unpack(head)
    if size > max_frame:
        raise _too_large(size, max_frame)
    if size <= CHUNK:
        body = bytearray(size)
        _recv_into(sock, memoryview(body), deadline)
        return body
    body = bytearray(CHUNK)
    have = 0
    while True:
        _recv_into(sock, memoryview(body)[have:], deadline)
        have = len(body)
        if have == size:
            return body
        body += bytes(min(size, 2 * have) - have)  # grow only once the previous part arrived


def send_frame(sock: socket.socket, frame: bytes, deadline: Deadline | None = None) -> None:
    """Send an encoded frame (``encode_frame``) within ``deadline`` (else the socket timeout)."""
    if deadline is not None:
        sock.settimeout(deadline.check("sending a frame"))
    try:
        sock.sendall(frame)
    except TimeoutError:
        if deadline is not None:
            raise DeadlineExceeded(
                f"sending a frame passed its {deadline.seconds:g} s deadline"
            ) from None
        raise


async def aread_frame(
    reader: asyncio.StreamReader, max_frame: int, *, frame_timeout: float | None = None
) -> bytes:
    """Read one frame from an asyncio stream (wrap in ``asyncio.wait_for`` for a deadline
    on the whole wait). ``frame_timeout``: once the length prefix has arrived, the body must
    arrive within this many seconds (else :class:`DeadlineExceeded`), so a server may wait
    long for a peer's next request but not for the rest of one it began -- a peer that
    stops in the middle of a large frame would otherwise hold what it sent that long."""
    try:
        head = await reader.readexactly(HEADER.size)
        (size,) = HEADER.unpack(head)
        if size > max_frame:
            raise _too_large(size, max_frame)
        if frame_timeout is None:
            return await _abody(reader, size)
        try:
            # A timer on this task, not wait_for's extra task per frame (a small request's
            # body is usually buffered already: the timer is then all this costs).
            async with asyncio.timeout(frame_timeout):
                return await _abody(reader, size)
        except TimeoutError:
            raise DeadlineExceeded(
                f"a frame of {size} bytes did not arrive within {frame_timeout:g} s"
            ) from None
    except asyncio.IncompleteReadError:
        raise PeerClosed("peer closed the connection") from None


async def _abody(reader: asyncio.StreamReader, size: int) -> bytes:
    if size <= CHUNK:
        return await reader.readexactly(size)
    parts = bytearray()
    while len(parts) < size:
        parts += await reader.readexactly(min(size - len(parts), max(CHUNK, len(parts))))
    return bytes(parts)
