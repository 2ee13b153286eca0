"""TCP transport between replicas: authenticated connections carrying length-prefixed
msgpack frames of Raft messages.

Each node listens on its own address and opens one outbound connection per peer; a
message from A to B always travels on A's connection to B. A connection opens with the
:mod:`kvmesh.net` handshake (service ``"replog-peer"``, role ``replica``, peer ids = node
ids): with the cluster secret configured the connecting node proves it holds the key of
*replica N* (derived from the secret; no client or storage-node credential yields it), and
the listener refuses any other role and any id outside the current membership, so it learns
the *authenticated* id of a member. Then frames (:mod:`kvmesh.net.framing`: a u32 LE
length, then the body) whose body is::

    [kind u8][payload]

``kind``: ``MSG`` (one encoded message), ``FRAG``/``FRAG_END`` (pieces of one large
message, e.g. an InstallSnapshot carrying a big state-machine image). Fragments of one
message are sent between other messages, so heartbeats keep flowing while a snapshot
streams.

What a listener accepts (everything else closes the connection or drops the message):

* at most ``max_connections`` connections (``max_unauthenticated`` of them still in the
  handshake, which must finish within ``handshake_timeout_s``, at most
  ``max_unauthenticated_per_source`` of those from one address; when a cap is reached a
  newcomer evicts the oldest connection still in its handshake, its own source's first:
  :class:`kvmesh.net.ConnectionLimiter`), ``max_conns_per_peer`` per authenticated node id;
* frames up to ``max_frame`` bytes; a frame that has started must be complete within
  ``frame_timeout_s`` (a truncated frame does not hold the connection), and a connection
  with no frame for ``idle_timeout_s`` is closed;
* a reassembled message of at most ``max_message_bytes``; fragments buffered per node id
  (all its connections) and in total are capped the same way and by ``max_buffered_bytes``;
* only messages whose ``frm`` is the connection's authenticated node id and whose ``to``
  is this node (others are dropped and counted in ``forged_msgs``).

Raft tolerates loss, so the transport never blocks the caller: :meth:`Transport.send`
enqueues into a bounded per-peer queue; when a queue is full, a connection fails or a
write stalls past ``write_timeout_s``, messages are dropped and the node is told through
``on_unreachable`` (and ``on_snapshot_status(peer, False)`` for a snapshot), so the leader
falls back to probing. Reconnects back off exponentially up to ``max_backoff_s``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections import deque
from collections.abc import Callable

import msgspec

from ...net import (
    REPLICA,
    TRANSPORT_ERRORS,
    ConnectionLimiter,
    DeadlineWatch,
    FrameDecoder,
    FrameTooLarge,
    SecurityConfig,
    ServerHandshake,
    Slot,
    Watched,
    aclient_handshake,
    arun_server,
    check_bind,
    client_ssl_context,
    clip,
    read_frames,
    server_ssl_context,
)
from ...net.addr import split_host_port
from ...net.limits import MIN_HANDSHAKE_AGE_S
from ...net.listener import Listener, start_listener
from ...net.throttle import LogThrottle
from ..errors import FrameError
from ..types import InstallSnapshot, decode_message, encode_message
from .protocol import PEER_SERVICE

__all__ = [
    "DeadlineWatch",
    "FrameError",
    "Transport",
    "TransportConfig",
    "parse_addr",
    "read_frames",
]

log = logging.getLogger(__name__)

_HDR = struct.Struct("<IB")  # net framing's u32 length, then the kind byte (first body byte)
MSG, FRAG, FRAG_END = 1, 2, 3


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port) (:mod:`kvmesh.net.addr`)."""
    return split_host_port(addr)


class TransportConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Queue bounds, fragment size, timeouts and the listener's limits (module docstring)."""

    max_queue_msgs: int = 8192
    max_queue_bytes: int = 256 << 20
    fragment_bytes: int = 1 << 20
    connect_timeout_s: float = 1.0
    write_timeout_s: float = 5.0
    min_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    handshake_timeout_s: float = 5.0
    max_frame: int = 4 << 20
    max_message_bytes: int = 256 << 20
    max_buffered_bytes: int = 512 << 20
    max_connections: int = 64
    max_unauthenticated: int = 16
    max_unauthenticated_per_source: int = 8
    max_conns_per_peer: int = 4
    idle_timeout_s: float = 60.0
    frame_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_frame < self.fragment_bytes + 1:
            raise ValueError("max_frame must hold a whole fragment (fragment_bytes + 1)")
        if self.max_message_bytes > self.max_buffered_bytes:
            raise ValueError("max_message_bytes cannot exceed max_buffered_bytes")


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Peer:
    def __init__(self, tr: Transport, peer_id: int, addr: str) -> None:
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
        self.errors = 0  # connections that failed (any exception class)
        self.restarts = 0  # senders that ended and were restarted by the supervisor

    def start(self) -> None:
        self.task = t = asyncio.get_running_loop().create_task(
            self._run(), name=f"replog-peer-{self.id}"
        )
        t.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        """The sender's supervisor: a sender that ends while its peer is still wanted (a
        bug, an exception class :meth:`_run` does not expect) would cut this replica off
        from the peer for good, silently. Log it, count it and start another after a
        pause, so the loss is one backoff, not the cluster's availability."""
        if task.cancelled() or self.tr._closing or self.tr._peers.get(self.id) is not self:
            return
        exc = task.exception()
        self.restarts += 1
        log.error(
            "replog transport %d -> %d: sender ended (%s); restarting it (%d restarts)",
            self.tr.node_id, self.id, repr(exc) if exc else "returned", self.restarts,
            exc_info=exc,
        )  # fmt: skip
        self._close_writer()
        self._drop_all()
        loop = task.get_loop()
        loop.call_later(self.tr.cfg.max_backoff_s, self._restart)

    def _restart(self) -> None:
        if not self.tr._closing and self.tr._peers.get(self.id) is self:
            self.start()

    def enqueue(self, data: bytes, is_snapshot: bool) -> None:
        cfg = self.tr.cfg
        # An empty queue takes any one message, however big (a snapshot larger than the
        # byte bound must still be deliverable).
        if self.queue and (
            len(self.queue) >= cfg.max_queue_msgs
            or self.queued_bytes + len(data) > cfg.max_queue_bytes
        ):
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
        tr = self.tr
        host, port = parse_addr(self.addr)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=tr._client_ssl), tr.cfg.connect_timeout_s
        )
        try:
            _nodelay(writer)
            peer = await aclient_handshake(
                reader,
                writer,
                tr.security,
                PEER_SERVICE,
                str(tr.node_id),
                tr.cfg.handshake_timeout_s,
                role=REPLICA,
            )
            if peer != str(self.id):
                raise ConnectionError(f"{self.addr} is node {clip(peer, 40)}, expected {self.id}")
        except BaseException:
            writer.close()
            raise
        # We never read from an outbound connection after the handshake; a closed peer
        # shows up as a write error.
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
            except Exception as e:  # noqa: BLE001 - any failure costs a reconnect, not the sender
                # TRANSPORT_ERRORS is what a failing connection raises on either event loop;
                # anything else is a bug, logged as one, and still only a reconnect.
                self.errors += 1
                expected = isinstance(e, TRANSPORT_ERRORS)
                if not expected or self.connected or backoff == cfg.min_backoff_s:
                    log.log(
                        logging.INFO if expected else logging.ERROR,
                        "replog transport %d -> %d (%s): %s: %s",
                        self.tr.node_id,
                        self.id,
                        self.addr,
                        type(e).__name__,
                        clip(str(e)),
                        exc_info=None if expected else e,
                    )
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
                data, _is_snap = self.queue[0]
                if len(data) > frag:
                    if parts:
                        break
                    big = self.queue.popleft()
                    self.queued_bytes -= len(data)
                    break
                self.queue.popleft()
                self.queued_bytes -= len(data)
                parts.append(_HDR.pack(len(data) + 1, MSG))
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
                w.write(_HDR.pack(end - pos + 1, kind))
                w.write(mv[pos:end])
                pos = end
                await asyncio.wait_for(w.drain(), cfg.write_timeout_s)
                # Let small messages (heartbeats, appends) through between fragments.
                small = []
                while self.queue and len(self.queue[0][0]) <= cfg.fragment_bytes:
                    d, _ = self.queue.popleft()
                    self.queued_bytes -= len(d)
                    small.append(_HDR.pack(len(d) + 1, MSG))
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

    ``on_message(msg)`` is called on the event loop for every decoded message (its
    ``frm`` is the authenticated sender); ``on_unreachable(peer)`` when messages to
    ``peer`` were dropped; ``on_snapshot_status(peer, ok)`` when an InstallSnapshot was
    fully written or failed. ``security``: the cluster token / TLS files (default: none,
    which :func:`kvmesh.net.check_bind` allows on loopback only).
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
        security: SecurityConfig | None = None,
    ) -> None:
        self.node_id = node_id
        self.listen_addr = listen_addr
        self.cfg = cfg = config or TransportConfig()
        self.security = security or SecurityConfig()
        self._client_ssl = client_ssl_context(self.security)
        self._limiter = ConnectionLimiter(
            cfg.max_connections,
            cfg.max_unauthenticated,
            cfg.max_unauthenticated_per_source,
            min_handshake_age_s=MIN_HANDSHAKE_AGE_S,
        )
        self._watch = DeadlineWatch(cfg.idle_timeout_s, cfg.frame_timeout_s)
        self._throttle = LogThrottle(log, 5.0)
        self._per_peer_conns: dict[int, int] = {}
        self._per_peer_bytes: dict[int, int] = {}
        self._buffered = 0
        self.forged_msgs = 0
        self.refused_handshakes = 0  # wrong key, role or id (or a broken handshake)
        self.on_message = on_message
        self.on_unreachable = on_unreachable
        self.on_snapshot_status = on_snapshot_status
        self._peers: dict[int, _Peer] = {}
        self._initial = {p: a for p, a in peers.items() if p != node_id}
        self._server: Listener | None = None
        self._conns: set[asyncio.Task] = set()
        self._conn_writers: set[asyncio.StreamWriter] = set()
        self._closing = False
        self.received_msgs = 0
        self.bad_frames = 0

    async def start(self) -> None:
        host, port = parse_addr(self.listen_addr)
        check_bind(host, self.security)
        # The shared accept path: a connect flood is refused at accept cost, before it can
        # fill the accept queue and drop the leader's SYNs (docs/net.md, "Connect floods").
        self._server = await start_listener(
            self._serve,
            host,
            port,
            self._limiter,
            ssl=server_ssl_context(self.security),
            greet=self._new_handshake,
        )
        for p, a in self._initial.items():
            self.add_peer(p, a)

    def _new_handshake(self) -> ServerHandshake:
        return ServerHandshake(self.security, PEER_SERVICE, str(self.node_id), accept=self._accept)

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

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slot: Slot
    ) -> None:
        # ``slot``: the listener's admission (kvmesh.net.listener): a newcomer evicts the
        # oldest stalled handshake (of its own source first), so a flood without the token
        # delays a replica by about one handshake round trip, and one from another address
        # not at all (docs/net.md, "Frames and limits").
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        self._conn_writers.add(writer)
        cfg = self.cfg
        peer = 0
        dec = FrameDecoder(cfg.max_frame)
        watched: Watched | None = None
        pending = bytearray()
        held = 0  # bytes this connection holds against the per-peer and total budgets
        try:
            try:
                # Begun by the listener when it greeted the connection (kvmesh.net.listener).
                hs = slot.handshake or self._new_handshake()
                who = await arun_server(reader, writer, hs, cfg.handshake_timeout_s)
            except TRANSPORT_ERRORS as e:
                self.refused_handshakes += 1
                raise FrameError(f"handshake failed: {clip(str(e))}") from None
            if not self._limiter.authenticated(slot):
                return  # evicted for a newer connection while still in its handshake
            peer = int(who)  # _accept admitted only a member's id
            n = self._per_peer_conns.get(peer, 0)
            if n >= cfg.max_conns_per_peer:
                raise FrameError(f"node {peer} already has {n} connections")
            self._per_peer_conns[peer] = n + 1
            watched = self._watch.watch(writer, dec)
            while True:
                bodies = await read_frames(reader, watched)
                for body in bodies:
                    if not body:
                        raise FrameError(f"empty frame from node {peer}")
                    kind = body[0]
                    if kind == MSG:
                        data: bytes | bytearray | memoryview = memoryview(body)[1:]
                    elif kind in (FRAG, FRAG_END):
                        size = len(body) - 1
                        if len(pending) + size > cfg.max_message_bytes:
                            raise FrameError(
                                f"fragmented message from node {peer} "
                                f"exceeds {cfg.max_message_bytes} bytes"
                            )
                        if (
                            self._per_peer_bytes.get(peer, 0) + size > cfg.max_message_bytes
                            or self._buffered + size > cfg.max_buffered_bytes
                        ):
                            raise FrameError(f"node {peer} exceeds the buffered-bytes budget")
                        pending += memoryview(body)[1:]
                        held += size
                        self._per_peer_bytes[peer] = self._per_peer_bytes.get(peer, 0) + size
                        self._buffered += size
                        if kind == FRAG:
                            continue
                        data, pending = pending, bytearray()
                        self._release(peer, held)
                        held = 0
                    else:
                        raise FrameError(f"unknown frame kind {kind} from node {peer}")
                    try:
                        msg = decode_message(data)
                    except (msgspec.DecodeError, msgspec.ValidationError) as e:
                        raise FrameError(
                            f"undecodable message from node {peer}: {clip(str(e))}"
                        ) from e
                    if msg.frm != peer or msg.to != self.node_id:
                        # The id is bound to the connection by the handshake: a message that
                        # claims another sender (or is for someone else) is forged.
                        self.forged_msgs += 1
                        if self.forged_msgs <= 10 or self.forged_msgs % 1000 == 0:
                            log.warning(
                                "replog transport %d: dropped %s claiming %d->%d "
                                "on node %d's connection (%d so far)",
                                self.node_id, type(msg).__name__, msg.frm, msg.to, peer,
                                self.forged_msgs,
                            )  # fmt: skip
                        continue
                    self.received_msgs += 1
                    self.on_message(msg)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        except (TimeoutError, FrameError, FrameTooLarge) as e:
            self.bad_frames += 1
            # Before authentication, one line per interval: a connect flood must not cost a
            # log line (more CPU than the refusal) per connection.
            self._throttle.log(
                logging.WARNING,
                "peer" if peer else "preauth",
                "replog transport %d: closing connection from node %s: %s",
                self.node_id,
                peer or "?",
                e,
            )
        except TRANSPORT_ERRORS as e:  # e.g. uvloop's RuntimeError on a reset connection
            log.info(
                "replog transport %d: connection from node %s failed: %s: %s",
                self.node_id, peer or "?", type(e).__name__, clip(str(e)),
            )  # fmt: skip
        except Exception:  # a bug must cost one connection, never the listener
            log.exception(
                "replog transport %d: connection from node %s failed", self.node_id, peer or "?"
            )
        finally:
            if watched is not None:
                self._watch.unwatch(watched)
            self._release(peer, held)
            if peer:
                left = self._per_peer_conns.get(peer, 1) - 1
                if left:
                    self._per_peer_conns[peer] = left
                else:
                    self._per_peer_conns.pop(peer, None)
            self._limiter.release(slot)
            self._conns.discard(task)
            self._conn_writers.discard(writer)
            writer.close()

    def _accept(self, role: str, who: str) -> str | None:
        """The handshake's policy: only replicas of the current membership (the peers this
        node sends to), never this node's own id."""
        if role != REPLICA:
            return "only replicas may connect to a raft port"
        # Canonical decimal only: "01" must not pass as node 1 (its key is another's).
        if not (who.isascii() and who.isdigit()) or str(int(who)) != who:
            return "not a node id"
        if int(who) == self.node_id or int(who) not in self._peers:
            return f"not a member of node {self.node_id}'s group"
        return None

    def _release(self, peer: int, n: int) -> None:
        if n:
            self._buffered -= n
            left = self._per_peer_bytes.get(peer, 0) - n
            if left > 0:
                self._per_peer_bytes[peer] = left
            else:
                self._per_peer_bytes.pop(peer, None)

    def stats(self) -> dict[int, dict[str, int | bool]]:
        return {
            p.id: {
                "connected": p.connected,
                "queued": len(p.queue),
                "sent": p.sent_msgs,
                "dropped": p.dropped_msgs,
                "errors": p.errors,
                "restarts": p.restarts,
            }
            for p in self._peers.values()
        }

    async def stop(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        for p in list(self._peers.values()):
            await p.stop()
        self._watch.stop()
        for w in list(self._conn_writers):
            w.close()  # a read that missed its cancellation ends at EOF, not at a timeout
        for t in list(self._conns):
            t.cancel()
        for t in list(self._conns):
            try:
                await t
            except BaseException:  # noqa: BLE001
                pass
