"""The engine's control server and its client side (peer connections, liveness watch).

Plain blocking TCP sockets and threads: the engine is called from synchronous code in many
threads (SGLang workers), blocking ``recv_into``/``sendmsg`` move bulk bytes fastest from
Python, and a blocked thread costs no CPU (an idle engine stays near 0 %).

* :class:`ControlServer` accepts connections, authenticates them and answers requests:
  segment descriptors, pings, transport calls, and the TCP data path (``WriteReq`` payloads
  are received straight into the target segment, ``ReadReq`` answers are pushed straight
  from it).
* :class:`PeerClient` is this engine's view of one remote engine: a pool of authenticated
  connections and a *watch* connection whose closing (process death, engine close) marks the
  peer dead at once, so in-flight transfers to it fail fast instead of hanging.
* :class:`Monitor` is the one thread that waits on every watch connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np

from . import protocol as P
from .errors import (
    AuthError,
    EngineClosed,
    InvalidLength,
    PeerDeadError,
    ProtocolError,
    SegmentNotFound,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
    error_from_code,
)
from .ranges import check_ranges
from .transports.base import PeerLiveness
from .types import EngineConfig, SegmentDescriptor

log = logging.getLogger("kvmesh.transfer")


class Identity:
    """Who an engine is, as told to peers during the handshake."""

    __slots__ = ("node_id", "engine_id", "host_id")

    def __init__(self, node_id: str, engine_id: str, host_id: str) -> None:
        self.node_id = node_id
        self.engine_id = engine_id
        self.host_id = host_id


def _tune(sock: socket.socket, keepalive: bool) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if keepalive:
        # Detects peers whose host vanished without a RST (real networks; loopback gets RSTs).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, val in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)


def primary_ip() -> str:
    """This host's address on its default route (no packet is sent), else loopback."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))
        return probe.getsockname()[0]
    except OSError:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    finally:
        probe.close()


def _offsets(raw: bytes) -> np.ndarray:
    if len(raw) % 8:
        raise ProtocolError(f"offset/length array of {len(raw)} bytes is not a uint64 array")
    return np.frombuffer(raw, dtype="<u8")


SegmentLookup = Callable[[str, int], "tuple[SegmentDescriptor, object]"]


class ControlServer:
    """Threaded control/data server of one engine (see module docstring)."""

    def __init__(
        self,
        listen: str,
        identity: Identity,
        config: EngineConfig,
        *,
        lookup: Callable[[str], "tuple[SegmentDescriptor, object]"],
        list_segments: Callable[[], list[SegmentDescriptor]],
        call: Callable[[str, bytes], bytes],
    ) -> None:
        host, port = P.split_host_port(listen)
        self.identity = identity
        self.config = config
        self._lookup = lookup
        self._list = list_segments
        self._call = call
        self._lsock = socket.create_server((host, port), backlog=128)
        bound = self._lsock.getsockname()
        bhost = bound[0]
        if bhost in ("0.0.0.0", "::", ""):
            bhost = primary_ip()  # a wildcard is not an address peers can use
        if ":" in bhost:
            bhost = f"[{bhost}]"
        self.address = config.advertise or f"{bhost}:{bound[1]}"
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._watchers: dict[socket.socket, threading.Lock] = {}
        self._closed = False
        self._threads: set[threading.Thread] = set()
        self._accept = threading.Thread(target=self._accept_loop, name="kvmesh-accept", daemon=True)
        self._accept.start()

    # --- accept / connection threads ------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._lsock.accept()
            except OSError:
                return  # listening socket shut down by close()
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns.add(sock)
                t = threading.Thread(target=self._serve, args=(sock,), name="kvmesh-conn", daemon=True)
                self._threads.add(t)
            t.start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            _tune(sock, self.config.tcp_keepalive)
            if self._handshake(sock):
                buf = bytearray(4096)
                while True:
                    msg = P.recv_msg(sock, buf)
                    self._dispatch(sock, msg)
        except (TransferError, OSError) as exc:
            if not self._closed and not isinstance(exc, PeerDeadError):
                log.debug("control connection ended: %r", exc)
        except Exception:  # a bug must cost one connection, never the server
            log.exception("control connection failed")
        finally:
            with self._lock:
                self._conns.discard(sock)
                self._watchers.pop(sock, None)
                self._threads.discard(threading.current_thread())
            with contextlib.suppress(OSError):
                sock.close()

    def _handshake(self, sock: socket.socket) -> bool:
        sock.settimeout(self.config.connect_timeout)
        nonce = secrets.token_bytes(16)
        token = self.config.token
        ident = self.identity
        P.send_msg(
            sock,
            P.Challenge(nonce, ident.node_id, ident.engine_id, ident.host_id, P.PROTOCOL_VERSION, token is not None),
        )
        hello = P.recv_msg(sock)
        if not isinstance(hello, P.Hello):
            raise ProtocolError(f"expected hello, got {type(hello).__name__}")
        if hello.version != P.PROTOCOL_VERSION:
            P.send_msg(sock, P.Error("protocol", f"protocol version {hello.version} != {P.PROTOCOL_VERSION}"))
            return False
        if not P.mac_ok(token, nonce, hello.engine_id, hello.mac):
            why = "wrong token" if hello.mac is not None else "no token given"
            if token is None:
                why = "this peer has no token configured"
            P.send_msg(sock, P.Error("auth", f"authentication failed for node {hello.node_id!r}: {why}"))
            log.warning("refused connection from node %r: %s", hello.node_id, why)
            return False
        P.send_msg(sock, P.Welcome(P.mac(token, hello.nonce, ident.engine_id)))
        if hello.watch:
            with self._lock:
                self._watchers[sock] = threading.Lock()
            sock.settimeout(None)
            # The client never sends on a watch connection: block until it closes.
            while sock.recv(1):
                pass
            return False
        sock.settimeout(None)  # idle data connections wait without cost
        return True

    def _dispatch(self, sock: socket.socket, msg: P.Message) -> None:
        if isinstance(msg, P.WriteReq):
            self._write(sock, msg)
        elif isinstance(msg, P.ReadReq):
            self._read(sock, msg)
        elif isinstance(msg, P.GetSegment):
            try:
                desc, _ = self._lookup(msg.name)
            except TransferError as exc:
                P.send_msg(sock, P.Error(exc.code, str(exc)))
            else:
                P.send_msg(sock, P.SegmentInfo(desc))
        elif isinstance(msg, P.ListSegments):
            P.send_msg(sock, P.SegmentList(self._list()))
        elif isinstance(msg, P.Ping):
            P.send_msg(sock, P.Pong(msg.seq))
        elif isinstance(msg, P.Call):
            try:
                reply = self._call(msg.kind, msg.payload)
            except TransferError as exc:
                P.send_msg(sock, P.Error(exc.code, str(exc)))
            except Exception as exc:  # a transport bug must not kill the connection silently
                log.exception("transport call %s failed", msg.kind)
                P.send_msg(sock, P.Error("transfer", f"{msg.kind} call failed: {exc!r}"))
            else:
                P.send_msg(sock, P.CallReply(reply))
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} on a control connection")

    def _resolve(self, name: str, seg_id: int, offsets: np.ndarray, lengths: np.ndarray, total: int):
        desc, region = self._lookup(name)
        if desc.seg_id != seg_id:
            raise SegmentNotFound(f"segment {name!r} was replaced (descriptor {seg_id} is stale)")
        if not desc.kind.is_host:
            raise TransportUnavailable(f"segment {name!r} is GPU memory; the TCP path moves host memory only")
        nbytes = check_ranges(f"request on segment {name!r}", lengths,
                              (offsets, desc.size, f"segment {name!r}"))
        if nbytes != total:
            raise InvalidLength(f"payload size {total} does not match the request lengths")
        region.acquire()
        return region

    def _write(self, sock: socket.socket, req: P.WriteReq) -> None:
        offsets, lengths = _offsets(req.offsets), _offsets(req.lengths)
        try:
            region = self._resolve(req.segment, req.seg_id, offsets, lengths, req.total)
        except TransferError as exc:
            P.drain(sock, req.total)  # keep the stream in sync, then refuse
            P.send_msg(sock, P.Error(exc.code, str(exc)))
            return
        try:
            mv = memoryview(region.array())
            views = [mv[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist())]
            P.recv_into_views(sock, views)
        finally:
            region.release()
        P.send_msg(sock, P.Ack(req.total))

    def _read(self, sock: socket.socket, req: P.ReadReq) -> None:
        offsets, lengths = _offsets(req.offsets), _offsets(req.lengths)
        try:
            region = self._resolve(req.segment, req.seg_id, offsets, lengths, req.total)
        except TransferError as exc:
            P.send_msg(sock, P.Error(exc.code, str(exc)))
            return
        try:
            mv = memoryview(region.array())
            views = [memoryview(P.encode(P.ReadResp(req.total)))]
            views += [mv[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist())]
            P.send_views(sock, views)
        finally:
            region.release()

    # --- notifications --------------------------------------------------------------------
    def notify(self, msg: P.Message) -> None:
        """Push ``msg`` to every watching peer (segment removals, goodbye)."""
        frame = P.encode(msg)
        with self._lock:
            watchers = list(self._watchers.items())
        for sock, lock in watchers:
            with lock:
                try:
                    # Never block unpublish/close on a stuck watcher: frames are tiny and the
                    # peer's monitor drains them at once; one that cannot keep up is dropped.
                    if sock.send(frame, socket.MSG_DONTWAIT) != len(frame):
                        raise BlockingIOError("partial notification")
                except OSError as exc:
                    log.warning("dropping a watcher that cannot take notifications: %r", exc)
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)

    def close(self, reason: str = "engine closed") -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.notify(P.Bye(reason))
        with contextlib.suppress(OSError):
            self._lsock.shutdown(socket.SHUT_RDWR)
        self._lsock.close()
        with self._lock:
            conns = list(self._conns)
            threads = list(self._threads)
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self._accept.join(2.0)
        for t in threads:
            t.join(2.0)


class Connection:
    """One authenticated client connection (blocking socket + scratch buffer)."""

    __slots__ = ("sock", "buf")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray(4096)

    def request(self, msg: P.Message, timeout: float) -> P.Message:
        self.sock.settimeout(timeout)
        P.send_msg(self.sock, msg)
        return self.reply(timeout)

    def reply(self, timeout: float) -> P.Message:
        self.sock.settimeout(timeout)
        msg = P.recv_msg(self.sock, self.buf)
        if isinstance(msg, P.Error):
            raise error_from_code(msg.code, msg.message)
        return msg

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


M = TypeVar("M", bound=P.Message)


def _expect(msg: P.Message, cls: type[M]) -> M:
    if not isinstance(msg, cls):
        raise ProtocolError(f"expected {cls.__name__}, got {type(msg).__name__}")
    return msg


class PeerClient:
    """This engine's link to one remote engine: connection pool, calls, TCP data path, liveness."""

    def __init__(self, address: str, me: Identity, config: EngineConfig) -> None:
        self.address = address
        self._me = me
        self._config = config
        self._lock = threading.Lock()
        self._idle: list[Connection] = []
        self._watch: socket.socket | None = None
        self.node_id = ""
        self.engine_id = ""
        self.host_id = ""
        first = self._connect(watch=False)  # learns the peer identity, checks auth
        self.liveness = PeerLiveness(self.engine_id, address)
        self._idle.append(first)

    # --- connections ----------------------------------------------------------------------
    def _connect(self, watch: bool, timeout: float | None = None) -> Connection:
        host, port = P.split_host_port(self.address)
        timeout = self._config.connect_timeout if timeout is None else min(timeout, self._config.connect_timeout)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            if isinstance(exc, TimeoutError):
                raise TransferTimeout(f"connecting to peer {self.address}: timed out after {timeout}s") from None
            raise PeerDeadError(f"cannot connect to peer {self.address}: {exc}") from None
        try:
            _tune(sock, self._config.tcp_keepalive)
            conn = Connection(sock)
            sock.settimeout(timeout)
            ch = _expect(P.recv_msg(sock), P.Challenge)
            if ch.version != P.PROTOCOL_VERSION:
                raise ProtocolError(f"peer {self.address} speaks protocol {ch.version}")
            if self.engine_id and ch.engine_id != self.engine_id:
                raise PeerDeadError(f"peer {self.address} restarted (engine {self.engine_id} is gone)")
            token = self._config.token
            if (token is None) != (not ch.auth):
                raise AuthError(
                    f"token mismatch with peer {self.address}: "
                    + ("we have a token, the peer has none" if token else "the peer requires a token")
                )
            nonce = secrets.token_bytes(16)
            P.send_msg(
                sock,
                P.Hello(self._me.node_id, self._me.engine_id, nonce,
                        P.mac(token, ch.nonce, self._me.engine_id), watch=watch),
            )
            welcome = _expect(conn.reply(timeout), P.Welcome)
            if not P.mac_ok(token, nonce, ch.engine_id, welcome.mac):
                raise AuthError(f"peer {self.address} could not prove it knows the token")
            self.node_id, self.engine_id, self.host_id = ch.node_id, ch.engine_id, ch.host_id
            sock.settimeout(None)
            return conn
        except BaseException:
            sock.close()
            raise

    def open_watch(self) -> socket.socket:
        """Open the watch connection (its EOF is the peer's death notice)."""
        conn = self._connect(watch=True)
        self._watch = conn.sock
        return conn.sock

    @contextlib.contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[Connection]:
        """A pooled connection; closed instead of returned if anything went wrong on it.

        ``timeout`` bounds opening a new connection (a caller's deadline).
        """
        self.check_alive()
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._connect(watch=False, timeout=timeout)
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        with self._lock:
            if len(self._idle) < self._config.tcp_max_idle and self.liveness.alive:
                self._idle.append(conn)
                conn = None
        if conn is not None:
            conn.close()

    def check_alive(self) -> None:
        reason = self.liveness.dead_reason
        if reason is not None:
            raise PeerDeadError(f"peer {self.address} is dead: {reason}")

    # --- control calls --------------------------------------------------------------------
    def _call(self, msg: P.Message, timeout: float | None = None) -> P.Message:
        t = self._config.control_timeout if timeout is None else timeout
        try:
            with self.connection(t) as conn:
                return conn.request(msg, t)
        except PeerDeadError as exc:
            reason = self.liveness.dead_reason
            if reason is not None:
                raise PeerDeadError(f"peer {self.address} is dead: {reason}") from None
            raise PeerDeadError(f"peer {self.address}: {exc}") from None

    def get_segment(self, name: str) -> SegmentDescriptor:
        return _expect(self._call(P.GetSegment(name)), P.SegmentInfo).desc

    def list_segments(self) -> list[SegmentDescriptor]:
        return _expect(self._call(P.ListSegments()), P.SegmentList).descs

    def ping(self, timeout: float | None = None) -> float:
        """Round-trip time of one ping, in seconds."""
        t0 = time.perf_counter()
        seq = int.from_bytes(os.urandom(4), "little")
        pong = _expect(self._call(P.Ping(seq), timeout), P.Pong)
        if pong.seq != seq:
            raise ProtocolError("ping answered with the wrong sequence number")
        return time.perf_counter() - t0

    def call(self, kind: str, payload: bytes, timeout: float | None = None) -> bytes:
        return _expect(self._call(P.Call(kind, payload), timeout), P.CallReply).payload

    # --- TCP data path --------------------------------------------------------------------
    def write(
        self, desc: SegmentDescriptor, offsets: np.ndarray, lengths: np.ndarray, views: list[memoryview], total: int, timeout: float
    ) -> None:
        """Push ``views`` into ``desc`` at ``offsets``; returns once the owner acknowledged."""
        req = P.WriteReq(desc.name, desc.seg_id, offsets.astype("<u8", copy=False).tobytes(), lengths.astype("<u8", copy=False).tobytes(), total)
        with self.connection(timeout) as conn:
            conn.sock.settimeout(timeout)
            try:
                P.send_views(conn.sock, [memoryview(P.encode(req))] + views)
            except OSError as exc:
                raise P._io_error(exc, f"writing to {self.address}") from None
            _expect(conn.reply(timeout), P.Ack)

    def read(
        self, desc: SegmentDescriptor, offsets: np.ndarray, lengths: np.ndarray, views: list[memoryview], total: int, timeout: float
    ) -> None:
        """Ask the owner to push the ranges; receive them straight into ``views``."""
        req = P.ReadReq(desc.name, desc.seg_id, offsets.astype("<u8", copy=False).tobytes(), lengths.astype("<u8", copy=False).tobytes(), total)
        with self.connection(timeout) as conn:
            resp = _expect(conn.request(req, timeout), P.ReadResp)
            if resp.total != total:
                raise ProtocolError(
                    f"peer {self.address} answered {resp.total} bytes for a {total} byte read"
                )
            try:
                P.recv_into_views(conn.sock, views)
            except OSError as exc:
                raise P._io_error(exc, f"reading from {self.address}") from None

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            watch, self._watch = self._watch, None
        for c in idle:
            c.close()
        if watch is not None:
            with contextlib.suppress(OSError):
                watch.shutdown(socket.SHUT_RDWR)


class Monitor:
    """One thread waiting on every peer's watch connection (no polling, no timers).

    ``on_removed(peer, name, seg_id)`` runs for pushed segment removals and
    ``on_dead(peer, reason)`` once when a peer's watch connection ends.
    """

    def __init__(
        self,
        on_removed: Callable[[PeerClient, str, int], None],
        on_dead: Callable[[PeerClient, str], None],
    ) -> None:
        self._on_removed = on_removed
        self._on_dead = on_dead
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._pending: list[tuple[socket.socket, PeerClient | None]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvmesh-monitor", daemon=True)
        self._thread.start()

    def watch(self, sock: socket.socket, peer: PeerClient) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosed("engine is closed")
            self._pending.append((sock, peer))
        self._wake_w.send(b"\0")

    def _run(self) -> None:
        while True:
            for key, _ in self._sel.select():
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        self._wake_r.recv(4096)
                    with self._lock:
                        if self._closed:
                            self._shutdown()
                            return
                        pending, self._pending = self._pending, []
                    for sock, peer in pending:
                        self._sel.register(sock, selectors.EVENT_READ, peer)
                    continue
                self._readable(key.fileobj, key.data)  # type: ignore[arg-type]

    def _readable(self, sock: socket.socket, peer: PeerClient) -> None:
        reason = None
        try:
            sock.settimeout(2.0)  # a pushed frame arrives whole; never block the monitor long
            msg = P.recv_msg(sock)
            if isinstance(msg, P.SegmentRemoved):
                self._on_removed(peer, msg.name, msg.seg_id)
                return
            reason = f"peer said goodbye: {msg.reason}" if isinstance(msg, P.Bye) else f"unexpected {type(msg).__name__}"
        except TransferError as exc:
            reason = f"connection lost ({exc})"
        except OSError as exc:
            reason = f"connection lost ({exc})"
        self._sel.unregister(sock)
        with contextlib.suppress(OSError):
            sock.close()
        self._on_dead(peer, reason)

    def _shutdown(self) -> None:
        for key in list(self._sel.get_map().values()):
            if key.data is not None:
                with contextlib.suppress(OSError):
                    key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()
        self._wake_r.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        self._thread.join(2.0)
        self._wake_w.close()
