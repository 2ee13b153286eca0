"""Copy-free blocking socket I/O for the TCP data path, with optional request deadlines.

Clients use these helpers on sockets in timeout mode (``settimeout``), as they always did.
The control server runs its connections in *blocking* mode with kernel timeouts
(:func:`kernel_timeouts`): a receive or send returns after at most one tick without
CPython's poll-before-every-syscall of timeout mode, and after each call the request's
:class:`~kvmesh.net.Deadline` is checked. So a served request costs the same syscalls as an
unbounded one, a peer that trickles is cut at the deadline, and one that stops entirely at the
deadline plus at most one tick.
"""

from __future__ import annotations

import socket
import struct

from kvmesh.net import Deadline

from .errors import PeerDeadError

# iovecs per sendmsg / recvmsg_into call (IOV_MAX is 1024 on Linux). A receive returns what
# has arrived (often 64-256 KiB on loopback) and CPython acquires every buffer of the list on
# each call, so receives take fewer at a time than sends.
_IOV_SEND = 256
_IOV_RECV = 64
_SMALL_PIECE = 64 << 10  # below this, scatter many pieces per syscall


def kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Blocking mode, with every receive and send bounded by ``seconds`` in the kernel.

    A call that times out raises ``BlockingIOError``; the helpers below then check their
    deadline and retry, so ``seconds`` is the granularity of deadlines and idle waits.
    """
    sock.settimeout(None)
    sec = int(seconds)
    tv = struct.pack("ll", sec, int((seconds - sec) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _tick(deadline: Deadline | None) -> None:
    """A kernel timeout fired: fine unless the deadline passed (or there is none)."""
    if deadline is None:
        raise TimeoutError("socket operation timed out")
    deadline.check("request")


def _gone() -> PeerDeadError:
    return PeerDeadError("peer closed the connection mid-transfer")


def send_views(
    sock: socket.socket, views: list[memoryview], deadline: Deadline | None = None
) -> None:
    """Send every byte of ``views`` in order, gathering many buffers per syscall."""
    i = 0
    n = len(views)
    while i < n:
        chunk = views[i : i + _IOV_SEND]
        try:
            sent = sock.sendmsg(chunk)
        except BlockingIOError:
            _tick(deadline)
            continue
        if deadline is not None and deadline.expired():
            deadline.check("request")
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


def recv_into_views(
    sock: socket.socket, views: list[memoryview], deadline: Deadline | None = None
) -> None:
    """Fill every buffer of ``views`` in order, straight from the socket (no staging copy)."""
    i = 0
    n = len(views)
    while i < n:
        cur = views[i]
        try:
            if len(cur) >= _SMALL_PIECE:
                got = sock.recv_into(cur)
                if got == 0:
                    raise _gone()
                if got == len(cur):
                    i += 1
                else:
                    views[i] = cur[got:]
                continue
            chunk = views[i : i + _IOV_RECV]
            got = sock.recvmsg_into(chunk)[0]
        except BlockingIOError:
            _tick(deadline)
            continue
        finally:
            if deadline is not None and deadline.expired():
                deadline.check("request")
        if got == 0:
            raise _gone()
        for v in chunk:
            lv = len(v)
            if got >= lv:
                got -= lv
                i += 1
            else:
                if got:
                    views[i] = v[got:]
                break


def recv_exact(sock: socket.socket, view: memoryview, deadline: Deadline | None = None) -> None:
    """Fill ``view`` (EOF first: the peer is gone)."""
    while len(view):
        try:
            got = sock.recv_into(view)
        except BlockingIOError:
            _tick(deadline)
            continue
        if got == 0:
            raise _gone()
        if deadline is not None and deadline.expired():
            deadline.check("request")
        view = view[got:]


def drain(sock: socket.socket, nbytes: int, deadline: Deadline | None = None) -> None:
    """Read and discard ``nbytes`` (payload of a refused request), keeping the stream in sync."""
    scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
    while nbytes > 0:
        n = min(nbytes, len(scratch))
        recv_exact(sock, scratch[:n], deadline)
        nbytes -= n


def linger_close(
    sock: socket.socket, nbytes: int, deadline: Deadline | None, seconds: float = 2.0
) -> None:
    """After a final reply: stop sending and discard what the peer still sends, up to
    ``nbytes`` or its EOF, for at most ``seconds`` (or the deadline).

    Closing a socket with unread bytes in its receive queue makes the kernel answer with a
    reset, which can destroy the reply still in flight to a client that is busy sending the
    payload of a refused request: the client then sees "connection reset" instead of the
    refusal. A bounded drain first lets the reply arrive (the lingering close of HTTP
    servers). The caller closes the socket afterwards."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        return
    cap = Deadline(seconds)
    scratch = memoryview(bytearray(1 << 16))
    while nbytes > 0 and not cap.expired():
        if deadline is not None and deadline.expired():
            return
        try:
            got = sock.recv_into(scratch[: min(nbytes, len(scratch))])
        except BlockingIOError:
            continue  # a kernel timeout tick: check the clocks again
        except OSError:
            return
        if not got:
            return
        nbytes -= got
