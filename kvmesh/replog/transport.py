"""TCP transport between replicas: length-prefixed msgpack frames of Raft messages.

Each node listens on its own address and opens one outbound connection per peer; a
message from A to B always travels on A's connection to B. Frames are::

    [body length u32 LE][kind u8][body]

``kind``: ``HELLO`` (body: msgpack sender id, first frame of a connection), ``MSG`` (one
encoded message), ``FRAG``/``FRAG_END`` (pieces of one large message, e.g. an
InstallSnapshot carrying a big state-machine image). Fragments of one message are sent
between other messages, so heartbeats keep flowing while a snapshot streams.

Raft tolerates loss, so the transport never blocks the caller: :meth:`Transport.send`
enqueues into a bounded per-peer queue; when a queue is full, a connection fails or a
write stalls past ``write_timeout_s``, messages are dropped and the node is told through
``on_unreachable`` (and ``on_snapshot_status(peer, False)`` for a snapshot), so the leader
falls back to probing. Reconnects back off exponentially up to ``max_backoff_s``.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from collections.abc import Callable

import msgspec

from .types import InstallSnapshot, decode_message, encode_message

__all__ = ["Transport", "TransportConfig", "parse_addr", "FrameError"]

log = logging.getLogger(__name__)

_HDR = struct.Struct("<IB")
HELLO, MSG, FRAG, FRAG_END = 0, 1, 2, 3
MAX_FRAME = 64 << 20  # one frame; larger messages are fragmented
MAX_MESSAGE = 4 << 30  # reassembled message cap (a corrupt stream must not eat all memory)


class FrameError(Exception):
    """A peer sent a malformed frame; the connection is closed."""


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad address {addr!r}, expected host:port")
    return host, int(port)


class TransportConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Queue bounds, fragment size and timeouts of the replica transport."""

    max_queue_msgs: int = 8192
    max_queue_bytes: int = 256 << 20
    fragment_bytes: int = 1 << 20
    connect_timeout_s: float = 1.0
    write_timeout_s: float = 5.0
    min_backoff_s: float = 0.05
    max_backoff_s: float = 1.0


class _Peer:
    def __init__(self, tr: "Transport", peer_id: int, addr: str) -> None:
        self.tr = tr
        self.id = peer_id
        self.addr = addr
        self.queue: deque[tuple[bytes, bool]] = deque()  # (encoded message, is_snapshot)
        self.queued_bytes = 0
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.connected = False
        self.sent_msgs = 0
        self.dropped_msgs = 0

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"replog-peer-{self.id}")

    def enqueue(self, data: bytes, is_snapshot: bool) -> None:
        cfg = self.tr.cfg
        # An empty queue takes any one message, however big (a snapshot larger than the
        # byte bound must still be deliverable).
        if self.queue and (len(self.queue) >= cfg.max_queue_msgs or self.queued_bytes + len(data) > cfg.max_queue_bytes):
            self.dropped_msgs += 1
            self.tr._report(self.id, is_snapshot)
            return
        self.queue.append((data, is_snapshot))
        self.queued_bytes += len(data)
        self.wake.set()

    def _drop_all(self) -> None:
        had_snapshot = any(s for _, s in self.queue)
        n = len(self.queue)
        self.queue.clear()
        self.queued_bytes = 0
        if n:
            self.dropped_msgs += n
            self.tr._report(self.id, had_snapshot)

    async def _connect(self) -> asyncio.StreamWriter:
        host, port = parse_addr(self.addr)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), self.tr.cfg.connect_timeout_s)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            import socket

            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = msgspec.msgpack.encode(self.tr.node_id)
        writer.write(_HDR.pack(len(hello), HELLO) + hello)
        # We never read from an outbound connection; a closed peer shows up as a write error.
        return writer

    async def _run(self) -> None:
        cfg = self.tr.cfg
        backoff = cfg.min_backoff_s
        while not self.tr._closing:
            if not self.queue:
                self.wake.clear()
                await self.wake.wait()
                continue
            try:
                if self.writer is None:
                    self.writer = await self._connect()
                    self.connected = True
                    backoff = cfg.min_backoff_s
                await self._drain_queue(self.writer)
            except (OSError, asyncio.TimeoutError, ConnectionError) as e:
                if self.connected or backoff == cfg.min_backoff_s:
                    log.info("replog transport %d -> %d (%s): %s", self.tr.node_id, self.id, self.addr, e or type(e).__name__)
                self._close_writer()
                self._drop_all()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, cfg.max_backoff_s)

    async def _drain_queue(self, w: asyncio.StreamWriter) -> None:
        cfg = self.tr.cfg
        frag = cfg.fragment_bytes
        while self.queue:
            # Coalesce all small messages queued now into one write.
            parts: list[bytes] = []
            big: tuple[bytes, bool] | None = None
            while self.queue:
                data, is_snap = self.queue[0]
                if len(data) > frag:
                    if parts:
                        break
                    big = self.queue.popleft()
                    self.queued_bytes -= len(data)
                    break
                self.queue.popleft()
                self.queued_bytes -= len(data)
                parts.append(_HDR.pack(len(data), MSG))
                parts.append(data)
                self.sent_msgs += 1
            if parts:
                w.write(b"".join(parts))
                await asyncio.wait_for(w.drain(), cfg.write_timeout_s)
            if big is not None:
                await self._send_big(w, big[0], big[1])

    async def _send_big(self, w: asyncio.StreamWriter, data: bytes, is_snap: bool) -> None:
        cfg = self.tr.cfg
        mv = memoryview(data)
        n = len(mv)
        pos = 0
        try:
            while pos < n:
                end = min(n, pos + cfg.fragment_bytes)
                kind = FRAG_END if end == n else FRAG
                w.write(_HDR.pack(end - pos, kind))
                w.write(mv[pos:end])
                pos = end
                await asyncio.wait_for(w.drain(), cfg.write_timeout_s)
                # Let small messages (heartbeats, appends) through between fragments.
                small = []
                while self.queue and len(self.queue[0][0]) <= cfg.fragment_bytes:
                    d, _ = self.queue.popleft()
                    self.queued_bytes -= len(d)
                    small.append(_HDR.pack(len(d), MSG))
                    small.append(d)
                    self.sent_msgs += 1
                if small and pos < n:
                    w.write(b"".join(small))
                    await asyncio.wait_for(w.drain(), cfg.write_timeout_s)
                elif small:
                    w.write(b"".join(small))
        except BaseException:
            if is_snap:
                self.tr._snapshot_status(self.id, False)
            raise
        self.sent_msgs += 1
        if is_snap:
            # Delivered to the peer's socket; the peer's InstallSnapshotResp tells the rest.
            self.tr._snapshot_status(self.id, True)

    def _close_writer(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception:  # noqa: BLE001 - the socket may already be dead
                pass
        self.writer = None
        self.connected = False

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._close_writer()


class Transport:
    """Replica-to-replica messaging for one node.

    ``on_message(msg)`` is called on the event loop for every decoded message;
    ``on_unreachable(peer)`` when messages to ``peer`` were dropped;
    ``on_snapshot_status(peer, ok)`` when an InstallSnapshot was fully written or failed.
    """

    def __init__(
        self,
        node_id: int,
        listen_addr: str,
        peers: dict[int, str],
        on_message: Callable[[object], None],
        on_unreachable: Callable[[int], None] | None = None,
        on_snapshot_status: Callable[[int, bool], None] | None = None,
        config: TransportConfig | None = None,
    ) -> None:
        self.node_id = node_id
        self.listen_addr = listen_addr
        self.cfg = config or TransportConfig()
        self.on_message = on_message
        self.on_unreachable = on_unreachable
        self.on_snapshot_status = on_snapshot_status
        self._peers: dict[int, _Peer] = {}
        self._initial = {p: a for p, a in peers.items() if p != node_id}
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()
        self._closing = False
        self.received_msgs = 0
        self.bad_frames = 0

    async def start(self) -> None:
        host, port = parse_addr(self.listen_addr)
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)
        for p, a in self._initial.items():
            self.add_peer(p, a)

    def add_peer(self, peer_id: int, addr: str) -> None:
        if peer_id == self.node_id:
            return
        old = self._peers.get(peer_id)
        if old is not None:
            if old.addr == addr:
                return
            asyncio.get_running_loop().create_task(old.stop())
        p = _Peer(self, peer_id, addr)
        self._peers[peer_id] = p
        p.start()

    def remove_peer(self, peer_id: int) -> None:
        p = self._peers.pop(peer_id, None)
        if p is not None:
            asyncio.get_running_loop().create_task(p.stop())

    def peer_addresses(self) -> dict[int, str]:
        return {p.id: p.addr for p in self._peers.values()}

    def send(self, msgs: list) -> None:
        """Queue messages (never blocks); unknown destinations are reported unreachable."""
        for m in msgs:
            p = self._peers.get(m.to)
            is_snap = type(m) is InstallSnapshot
            if p is None:
                self._report(m.to, is_snap)
                continue
            p.enqueue(encode_message(m), is_snap)

    def _report(self, peer: int, snapshot: bool) -> None:
        if self.on_unreachable is not None:
            self.on_unreachable(peer)
        if snapshot:
            self._snapshot_status(peer, False)

    def _snapshot_status(self, peer: int, ok: bool) -> None:
        if self.on_snapshot_status is not None:
            self.on_snapshot_status(peer, ok)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        pending = bytearray()
        try:
            hdr = await reader.readexactly(_HDR.size)
            length, kind = _HDR.unpack(hdr)
            if kind != HELLO or length > 64:
                raise FrameError(f"expected HELLO, got kind {kind}")
            peer = msgspec.msgpack.decode(await reader.readexactly(length), type=int)
            while True:
                hdr = await reader.readexactly(_HDR.size)
                length, kind = _HDR.unpack(hdr)
                if length > MAX_FRAME:
                    raise FrameError(f"frame of {length} bytes from node {peer} exceeds {MAX_FRAME}")
                body = await reader.readexactly(length)
                if kind == MSG:
                    data: bytes | bytearray = body
                elif kind == FRAG:
                    pending += body
                    if len(pending) > MAX_MESSAGE:
                        raise FrameError(f"fragmented message from node {peer} exceeds {MAX_MESSAGE} bytes")
                    continue
                elif kind == FRAG_END:
                    pending += body
                    data, pending = pending, bytearray()
                else:
                    raise FrameError(f"unknown frame kind {kind} from node {peer}")
                try:
                    msg = decode_message(data)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    raise FrameError(f"undecodable message from node {peer}: {e}") from e
                self.received_msgs += 1
                self.on_message(msg)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        except FrameError as e:
            self.bad_frames += 1
            log.warning("replog transport %d: closing connection: %s", self.node_id, e)
        finally:
            self._conns.discard(task)
            writer.close()

    def stats(self) -> dict[int, dict[str, int | bool]]:
        return {
            p.id: {"connected": p.connected, "queued": len(p.queue), "sent": p.sent_msgs, "dropped": p.dropped_msgs}
            for p in self._peers.values()
        }

    async def stop(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        for p in list(self._peers.values()):
            await p.stop()
        for t in list(self._conns):
            t.cancel()
        for t in list(self._conns):
            try:
                await t
            except BaseException:  # noqa: BLE001
                pass
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            except asyncio.TimeoutError:
                pass
