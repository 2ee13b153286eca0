"""Plain-TCP transport, both halves: the network path when NIXL is absent or not preferred.

Both directions are *pushes* (a pulled stream over blocking sockets measured ~3x slower: 1.2
vs 3.6 GB/s for 1 MiB messages): a WRITE sends the pages after a ``WriteReq`` header and the
owner receives them with ``recv_into`` straight into the segment; a READ sends a ``ReadReq``
and the owner pushes the pages, which land with ``recv_into`` straight in local memory.
Adjacent pages travel as one range.

* Client half: :class:`TcpTransport` (and :func:`client_write` / :func:`client_read`, which the
  NIXL transport's owner-push READs use through ``PeerClient.read``). A job is cut into
  requests of at most ``max_request_pieces`` pieces and ``max_request_bytes`` bytes.
* Server half: :class:`TcpServer`, whose ``serve_write``/``serve_read`` the engine installs in
  its control server. Every request is checked (pieces, bytes, ranges, segment id) before a
  byte lands; each runs under the connection's request deadline; and the region it touches
  is registered with the connection, so ``unregister`` can end it.

Per-piece bookkeeping stays in numpy arrays: memoryviews exist only for a window of
:data:`WINDOW` pieces at a time, so a request of millions of small pieces costs its arrays,
not a Python object per piece.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from kvmesh.net import Deadline

from .. import protocol as P
from ..disk import DiskSegment
from ..errors import (
    InvalidLength,
    PeerDeadError,
    ProtocolError,
    RequestTooLarge,
    SegmentNotFound,
    TransferError,
    TransportUnavailable,
)
from ..memory import MemoryRegion
from ..ranges import check_ranges
from ..sockio import drain, linger_close, recv_into_views, send_views
from ..types import EngineConfig, Op, SegmentDescriptor, TransportKind
from .base import TransferJob, Transport

if TYPE_CHECKING:  # pragma: no cover
    from ..control import PeerClient, Served

WINDOW = 1024  # pieces with live memoryviews at a time


def _windows(
    base: memoryview, offsets: np.ndarray, lengths: np.ndarray
) -> Iterator[list[memoryview]]:
    if len(lengths) <= WINDOW:  # most requests: one window, no slicing
        yield [base[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist())]
        return
    for i in range(0, len(lengths), WINDOW):
        offs = offsets[i : i + WINDOW].tolist()
        lens = lengths[i : i + WINDOW].tolist()
        yield [base[o : o + n] for o, n in zip(offs, lens)]


def send_ranges(
    sock: socket.socket,
    base: memoryview,
    offsets: np.ndarray,
    lengths: np.ndarray,
    head: bytes = b"",
    deadline: Deadline | None = None,
) -> None:
    """Send ``head`` then the ranges ``base[offsets[i] : offsets[i] + lengths[i]]`` in order."""
    first = [memoryview(head)] if head else []
    for views in _windows(base, offsets, lengths):
        if first:
            views[:0] = first
            first = []
        send_views(sock, views, deadline)
    if first:
        send_views(sock, first, deadline)


def recv_ranges(
    sock: socket.socket,
    base: memoryview,
    offsets: np.ndarray,
    lengths: np.ndarray,
    deadline: Deadline | None = None,
) -> None:
    """Receive straight into the ranges of ``base``, in order."""
    for views in _windows(base, offsets, lengths):
        recv_into_views(sock, views, deadline)


def request_chunks(
    lo: np.ndarray, ro: np.ndarray, ln: np.ndarray, max_pieces: int, max_bytes: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Cut (local offsets, remote offsets, lengths) into requests within the owner's limits.

    Pieces longer than ``max_bytes`` are split first; then consecutive pieces are grouped
    while both the piece count and the byte count stay within the limits. Vectorised.
    """
    lo = lo.astype(np.uint64, copy=False)
    ro = ro.astype(np.uint64, copy=False)
    ln = ln.astype(np.uint64, copy=False)
    mb = np.uint64(max_bytes)
    if len(ln) and int(ln.max()) > max_bytes:
        counts = ((ln + mb - np.uint64(1)) // mb).astype(np.int64)
        idx = np.repeat(np.arange(len(ln)), counts)
        starts = np.cumsum(counts) - counts
        within = (np.arange(int(counts.sum())) - np.repeat(starts, counts)).astype(np.uint64) * mb
        lo, ro = lo[idx] + within, ro[idx] + within
        ln = np.minimum(ln[idx] - within, mb)
    n = len(ln)
    if n <= max_pieces and int(ln.sum()) <= max_bytes:
        yield lo, ro, ln
        return
    csum = np.cumsum(ln, dtype=np.uint64)
    start = 0
    while start < n:
        before = int(csum[start - 1]) if start else 0
        end = int(np.searchsorted(csum, np.uint64(before + max_bytes), side="right"))
        end = max(start + 1, min(end, start + max_pieces, n))
        yield lo[start:end], ro[start:end], ln[start:end]
        start = end


# --- client half -----------------------------------------------------------------------------


def _u64(a: np.ndarray) -> bytes:
    return a.astype("<u8", copy=False).tobytes()


def client_write(
    peer: PeerClient,
    desc: SegmentDescriptor,
    ro: np.ndarray,
    ln: np.ndarray,
    total: int,
    timeout: float,
    send: Callable[[socket.socket, bytes], None],
) -> None:
    """One WRITE request: ``send(sock, header)`` pushes header and payload; waits for the Ack."""
    req = P.WriteReq(desc.name, desc.seg_id, _u64(ro), _u64(ln), total)
    with _segment_gone_explains(peer, desc), peer.connection(timeout) as conn:
        conn.sock.settimeout(timeout)
        try:
            send(conn.sock, P.encode(req))
        except OSError as exc:
            raise P.io_error(exc, f"writing to {peer.address}") from None
        P.expect(conn.reply(timeout), P.Ack)


def client_read(
    peer: PeerClient,
    desc: SegmentDescriptor,
    ro: np.ndarray,
    ln: np.ndarray,
    total: int,
    timeout: float,
    receive: Callable[[socket.socket], None],
) -> None:
    """One READ request: the owner answers ``ReadResp`` and pushes; ``receive(sock)`` lands it."""
    req = P.ReadReq(desc.name, desc.seg_id, _u64(ro), _u64(ln), total)
    with _segment_gone_explains(peer, desc), peer.connection(timeout) as conn:
        resp = P.expect(conn.request(req, timeout), P.ReadResp)
        if resp.total != total:
            raise ProtocolError(
                f"peer {peer.address} answered {resp.total} bytes for a {total} byte read"
            )
        try:
            receive(conn.sock)
        except OSError as exc:
            raise P.io_error(exc, f"reading from {peer.address}") from None


def write_views(
    peer: PeerClient,
    desc: SegmentDescriptor,
    ro: np.ndarray,
    ln: np.ndarray,
    views: list[memoryview],
    total: int,
    timeout: float,
) -> None:
    """Push ``views`` into ``desc`` at ``ro``; returns once the owner acknowledged."""

    def send(sock: socket.socket, head: bytes) -> None:
        send_views(sock, [memoryview(head), *views])

    client_write(peer, desc, ro, ln, total, timeout, send)


def read_views(
    peer: PeerClient,
    desc: SegmentDescriptor,
    ro: np.ndarray,
    ln: np.ndarray,
    views: list[memoryview],
    total: int,
    timeout: float,
) -> None:
    """Ask the owner to push the ranges; receive them straight into ``views`` (the NIXL
    transport's owner-push READs use this too)."""
    client_read(peer, desc, ro, ln, total, timeout, lambda sock: recv_into_views(sock, views))


@contextlib.contextmanager
def _segment_gone_explains(peer: PeerClient, desc: SegmentDescriptor) -> Iterator[None]:
    """A live owner that cuts a request off mid-stream does so because ``unregister`` took
    the segment away (``ControlServer.end_users_of``): answer that with SegmentNotFound, as
    docs/transfer.md promises, instead of the broken pipe. One GetSegment, on the error
    path only; a dead owner, or one that still has the segment, keeps the I/O error."""
    try:
        yield
    except PeerDeadError as exc:
        if peer.liveness.dead_reason is not None:
            raise
        try:
            now = peer.get_segment(desc.name, timeout=2.0)
        except SegmentNotFound:
            raise SegmentNotFound(
                f"segment {desc.name!r} of {peer.address} was removed during the transfer"
            ) from exc
        except TransferError:
            raise exc from None
        if now.seg_id != desc.seg_id:
            raise SegmentNotFound(
                f"segment {desc.name!r} of {peer.address} was replaced during the transfer"
            ) from exc
        raise


def _refusal(conn: Any, pending: int, until: float) -> None:
    """Raise the owner's error if one of the ``pending`` replies is a refusal: an owner that
    refused a request it could not skip closed the connection, and its reply says why better
    than the broken pipe does. Reads until ``until`` (monotonic) at most."""
    for _ in range(pending):
        left = until - time.monotonic()
        if left <= 0:
            return
        try:
            msg = conn.reply(left)
        except TransferError:
            raise  # the owner's answer (error_from_code), or a broken reply: both say more
        except Exception:  # noqa: BLE001 - nothing more to learn; the send error is raised
            return
        if not isinstance(msg, P.Ack):
            return


# WRITE requests a connection carries ahead of their Acks (execute_writes): the unread Acks
# and error replies (a few hundred bytes at most each) must fit in the socket buffers, or the
# owner would block on a reply while we block on a send.
PIPELINE_DEPTH = 32


class TcpTransport(Transport):
    """Pushes pages through the segment owner's control server."""

    kind = TransportKind.TCP
    pipelined_writes = True  # execute_writes: one connection, acks read behind

    def can_serve(self, local: MemoryRegion, remote: SegmentDescriptor) -> bool:
        return local.is_host and remote.kind.is_host

    def open(self, remote: SegmentDescriptor) -> Any:
        return self.ctx.peer(remote.control)

    def _parts(self, job: TransferJob) -> Any:
        """(local offsets, remote offsets, lengths, bytes) of each request of ``job``."""
        cfg = self.ctx.config
        lo, ro, ln = job.coalesced()
        if len(ln) <= cfg.max_request_pieces and job.nbytes <= cfg.max_request_bytes:
            return ((lo, ro, ln, job.nbytes),)  # the common case: one request
        return (
            (a, b, c, int(c.sum()))
            for a, b, c in request_chunks(lo, ro, ln, cfg.max_request_pieces, cfg.max_request_bytes)
        )

    def execute_writes(self, jobs: list[TransferJob]) -> None:
        """WRITE ``jobs`` (one peer, in order) back to back on one connection, reading each
        Ack up to :data:`PIPELINE_DEPTH` requests later instead of waiting a round trip per
        request: a PD request is one small job per layer buffer (64 x 512 KiB), and one
        round trip and thread hand-off each cost more CPU than their bytes (docs/sglang.md
        "16 concurrent requests"). The owner serves them exactly as one by one."""
        peer = jobs[0].route
        pending = 0
        with (
            _segment_gone_explains(peer, jobs[0].remote),
            peer.connection(jobs[0].remaining()) as conn,
        ):
            sock = conn.sock
            for job in jobs:
                job.check()
                base = memoryview(job.local.array())
                for lo, ro, ln, total in self._parts(job):
                    if pending >= PIPELINE_DEPTH:
                        P.expect(conn.reply(job.remaining()), P.Ack)
                        pending -= 1
                    req = P.WriteReq(job.remote.name, job.remote.seg_id, _u64(ro), _u64(ln), total)
                    sock.settimeout(job.remaining())
                    try:
                        send_ranges(sock, base, lo, ln, P.encode(req))
                    except OSError as exc:
                        if not isinstance(exc, TimeoutError):  # a stalled owner gets no more
                            _refusal(conn, pending, min(job.deadline, time.monotonic() + 0.5))
                        raise P.io_error(exc, f"writing to {peer.address}") from None
                    pending += 1
            while pending:
                P.expect(conn.reply(jobs[-1].remaining()), P.Ack)
                pending -= 1

    def execute(self, job: TransferJob) -> None:
        job.check()
        base = memoryview(job.local.array())
        peer = job.route
        for lo, ro, ln, total in self._parts(job):
            if job.op is Op.WRITE:
                client_write(
                    peer,
                    job.remote,
                    ro,
                    ln,
                    total,
                    job.remaining(),
                    lambda sock, head, lo=lo, ln=ln: send_ranges(sock, base, lo, ln, head),
                )
            else:
                client_read(
                    peer,
                    job.remote,
                    ro,
                    ln,
                    total,
                    job.remaining(),
                    lambda sock, lo=lo, ln=ln: recv_ranges(sock, base, lo, ln),
                )


# --- server half -----------------------------------------------------------------------------

Lookup = Callable[[str], "tuple[SegmentDescriptor, MemoryRegion]"]


class CloseConnection(TransferError):
    """The request cannot be answered in-stream (its payload cannot be skipped): close."""


class TcpServer:
    """Server half: answers ``WriteReq``/``ReadReq`` on this engine's control connections."""

    def __init__(self, lookup: Lookup, config: EngineConfig) -> None:
        self._lookup = lookup
        self.max_pieces = config.max_request_pieces
        self.max_bytes = config.max_request_bytes
        # The request frame carries two uint64 arrays; anything bigger is refused unread.
        self.max_frame = 16 * self.max_pieces + 2 * P.MAX_NAME + 256

    def handlers(self) -> dict[type, Callable[[Served, Any], None]]:
        return {P.WriteReq: self.serve_write, P.ReadReq: self.serve_read}

    def _arrays(self, req: P.WriteReq | P.ReadReq) -> tuple[np.ndarray, np.ndarray]:
        if req.total > self.max_bytes:
            raise RequestTooLarge(
                f"request of {req.total} bytes exceeds this engine's limit of "
                f"{self.max_bytes} bytes per request"
            )
        if len(req.offsets) % 8 or len(req.lengths) % 8:
            raise InvalidLength("offsets and lengths must be packed uint64 arrays")
        n = len(req.lengths) // 8
        if len(req.offsets) // 8 != n:
            raise InvalidLength(f"{len(req.offsets) // 8} offsets but {n} lengths")
        if n > self.max_pieces:
            raise RequestTooLarge(
                f"request of {n} pieces exceeds this engine's limit of "
                f"{self.max_pieces} pieces per request"
            )
        return np.frombuffer(req.offsets, "<u8"), np.frombuffer(req.lengths, "<u8")

    def _resolve(
        self, req: P.WriteReq | P.ReadReq, offsets: np.ndarray, lengths: np.ndarray
    ) -> MemoryRegion:
        desc, region = self._lookup(req.segment)
        if desc.seg_id != req.seg_id:
            raise SegmentNotFound(
                f"segment {req.segment!r} was replaced (descriptor {req.seg_id} is stale)"
            )
        if not desc.kind.is_host:
            raise TransportUnavailable(
                f"segment {req.segment!r} is GPU memory; the TCP path moves host memory only"
            )
        side = (offsets, desc.size, f"segment {req.segment!r}")
        if check_ranges(f"request on segment {req.segment!r}", lengths, side) != req.total:
            raise InvalidLength(f"payload size {req.total} does not match the request lengths")
        return region

    def _prepare(
        self, conn: Served, req: P.WriteReq | P.ReadReq
    ) -> tuple[MemoryRegion, np.ndarray, np.ndarray]:
        """Check the request and hold its region for this connection (or raise)."""
        offsets, lengths = self._arrays(req)
        region = self._resolve(req, offsets, lengths)
        conn.hold(region)
        return region, offsets, lengths

    def serve_write(self, conn: Served, req: P.WriteReq) -> None:
        sock = conn.sock
        try:
            region, offsets, lengths = self._prepare(conn, req)
        except TransferError as exc:
            if req.total > self.max_bytes:
                P.send_msg(sock, P.error_reply(exc))
                linger_close(sock, req.total, conn.deadline)  # the reply must not be reset
                raise CloseConnection(str(exc)) from None
            drain(sock, req.total, conn.deadline)  # keep the stream in sync, then refuse
            P.send_msg(sock, P.error_reply(exc))
            return
        try:
            if isinstance(region, DiskSegment):  # the owner writes the file (disk.py)
                failed = region.serve_write(sock, offsets, lengths, conn.deadline)
                if failed is not None:
                    P.send_msg(sock, P.error_reply(failed))
                    return
            else:
                recv_ranges(sock, memoryview(region.array()), offsets, lengths, conn.deadline)
        finally:
            conn.unhold(region)
        P.send_msg(sock, P.Ack(req.total))

    def serve_read(self, conn: Served, req: P.ReadReq) -> None:
        sock = conn.sock
        try:
            region, offsets, lengths = self._prepare(conn, req)
        except TransferError as exc:
            P.send_msg(sock, P.error_reply(exc))
            return
        try:
            if isinstance(region, DiskSegment):  # the owner reads the file (disk.py)
                head = P.encode(P.ReadResp(req.total))
                failed = region.serve_read(sock, offsets, lengths, head, conn.deadline)
                if failed is not None:
                    P.send_msg(sock, P.error_reply(failed))
                return
            send_ranges(
                sock,
                memoryview(region.array()),
                offsets,
                lengths,
                P.encode(P.ReadResp(req.total)),
                conn.deadline,
            )
        finally:
            conn.unhold(region)
