"""The engine's control server and its client side (peer connections, liveness watch).

Plain blocking TCP sockets and threads: the engine is called from synchronous code in many
threads (SGLang workers), blocking ``recv_into``/``sendmsg`` move bulk bytes fastest from
Python, and a blocked thread costs no CPU (an idle engine stays near 0 %).

* :class:`ControlServer` accepts connections, authenticates them with :mod:`kvmesh.net`
  (service ``"transfer"``) and answers requests: segment descriptors, pings, transport calls,
  and whatever the engine installs as handlers (the TCP transport's server half:
  ``transports/tcp.py``). Connections are accepted, admitted and authenticated by one
  thread (:class:`kvmesh.net.acceptor.Acceptor`: the one admission policy of every kvmesh
  server -- caps in total, in the handshake and per source address, eviction of the oldest
  stalled handshake, minimum handshake age, a first-come line per source, one absolute
  handshake deadline, 4 KiB pre-auth frames), so an unauthenticated connection costs no
  thread; each authenticated one gets a thread, with a frame limit, a deadline per request
  and an idle timeout. A failure costs one connection, never the port.
* :class:`PeerClient` is this engine's view of one remote engine: a pool of authenticated
  connections and a *watch* connection whose closing (process death, engine close) marks the
  peer dead at once, so in-flight transfers to it fail fast instead of hanging.
* :class:`Monitor` is the one thread that waits on every watch connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvmesh.net import (
    AuthFailed,
    ClientHandshake,
    ConnectionLimiter,
    Deadline,
    FrameDecoder,
    FrameTooLarge,
    HandshakeError,
    NetError,
    PeerClosed,
    SecurityConfig,
    ServerHandshake,
    Slot,
    check_bind,
    family_of,
    join_host_port,
    run_client,
)
from kvmesh.net.acceptor import Acceptor
from kvmesh.net.framing import CHUNK
from kvmesh.net.limits import MIN_HANDSHAKE_AGE_S
from kvmesh.net.throttle import LogThrottle

from . import protocol as P
from . import sockio
from .errors import (
    AuthError,
    EngineClosed,
    InvalidArgument,
    PeerDeadError,
    ProtocolError,
    RequestTooLarge,
    TransferError,
    TransferTimeout,
    error_from_code,
)
from .transports.base import PeerLiveness
from .types import EngineConfig, SegmentDescriptor

log = logging.getLogger("kvmesh.transfer")

BACKLOG = 1024  # a flood's connects wait in the kernel's queue behind at most this many


class Identity:
    """Who an engine is, as told to peers during the handshake."""

    __slots__ = ("node_id", "engine_id", "host_id")

    def __init__(self, node_id: str, engine_id: str, host_id: str) -> None:
        self.node_id = node_id
        self.engine_id = engine_id
        self.host_id = host_id


def security_of(config: EngineConfig) -> SecurityConfig:
    """The :mod:`kvmesh.net` security settings of an engine configuration."""
    token = config.token
    if config.token_file is not None:
        if token is not None:
            raise InvalidArgument("set token or token_file, not both")
        with open(config.token_file, encoding="utf-8") as f:
            token = f.read().strip()
        if not token:
            raise InvalidArgument(f"token file {config.token_file!r} is empty")
    if token == "":
        raise InvalidArgument("an empty token would authenticate everyone; leave it unset")
    cred = config.credential
    if config.credential_file is not None:
        if cred is not None:
            raise InvalidArgument("set credential or credential_file, not both")
        with open(config.credential_file, encoding="utf-8") as f:
            cred = f.read().strip() or None
    try:
        # Every engine speaks as a client (the default role): the client key, which a
        # node's credential carries too, verifies every peer's engine.
        return SecurityConfig(token=token, credential=cred, allow_insecure=config.allow_insecure)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


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


class Served:
    """One connection of the control server, as handlers see it."""

    __slots__ = ("sock", "deadline", "region", "peer_id")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.deadline: Deadline | None = None  # of the request being served
        self.region: Any = None  # the region a request of this connection holds
        self.peer_id = ""

    def hold(self, region: Any) -> None:
        """Acquire ``region`` for this request (``ControlServer.end_users_of`` can cut it)."""
        self.region = region
        try:
            region.acquire()
        except BaseException:
            self.region = None
            raise

    def unhold(self, region: Any) -> None:
        self.region = None
        region.release()


Handler = Callable[[Served, Any], None]


class ControlServer:
    """Threaded control/data server of one engine (see module docstring)."""

    def __init__(
        self,
        listen: str,
        identity: Identity,
        config: EngineConfig,
        *,
        lookup: Callable[[str], tuple[SegmentDescriptor, object]],
        list_segments: Callable[[], list[SegmentDescriptor]],
        call: Callable[[str, bytes], bytes],
        handlers: dict[type, Handler] | None = None,
        max_frame: int = 64 << 10,
    ) -> None:
        host, port = P.split_host_port(listen)
        self._sec = security_of(config)
        check_bind(host, self._sec)
        self.identity = identity
        self.config = config
        self._lookup = lookup
        self._list = list_segments
        self._call = call
        self._handlers = dict(handlers or {})
        # Requests are small apart from the data path's offset arrays (its handler's limit).
        self._max_frame = max(max_frame, CHUNK)
        self._limiter = ConnectionLimiter(
            config.max_connections,
            config.max_unauthenticated,
            config.max_unauthenticated_per_source,
            min_handshake_age_s=MIN_HANDSHAKE_AGE_S,
        )
        self._throttle = LogThrottle(log)
        self._info = P.encode_info(P.ServerInfo(identity.node_id, identity.host_id))
        self._lsock = socket.create_server((host, port), family=family_of(host), backlog=BACKLOG)
        bound = self._lsock.getsockname()
        bhost = bound[0]
        if bhost in ("0.0.0.0", "::", ""):
            bhost = primary_ip()  # a wildcard is not an address peers can use
        self.address = config.advertise or join_host_port(bhost, bound[1])
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, Served] = {}
        self._watchers: dict[socket.socket, threading.Lock] = {}
        self._closed = False
        self._threads: set[threading.Thread] = set()
        self._accept = Acceptor(
            self._lsock,
            self._limiter,
            self._new_handshake,
            self._ready,
            deadline_s=config.connect_timeout,
        )

    @property
    def limiter(self) -> ConnectionLimiter:
        return self._limiter

    # --- connection threads ---------------------------------------------------------------
    def _new_handshake(self) -> ServerHandshake:
        ident = self.identity
        return ServerHandshake(self._sec, P.SERVICE, ident.engine_id, info=self._info)

    def _ready(self, sock: socket.socket, hs: ServerHandshake, slot: Slot) -> None:
        # In the acceptor thread, after the handshake: the connection's own thread from here.
        conn = Served(sock)
        conn.peer_id = hs.peer_id or ""
        t = threading.Thread(
            target=self._serve, args=(conn, slot, hs), name="kvmesh-conn", daemon=True
        )
        with self._lock:
            if self._closed:
                self._limiter.release(slot)
                sock.close()
                return
            self._conns[sock] = conn
            self._threads.add(t)
        try:
            t.start()
        except BaseException:
            with self._lock:
                self._conns.pop(sock, None)
                self._threads.discard(t)
            self._limiter.release(slot)
            sock.close()
            raise

    def _serve(self, conn: Served, slot: Slot, hs: ServerHandshake) -> None:
        sock = conn.sock
        try:
            _tune(sock, self.config.tcp_keepalive)
            info = P.decode_info(hs.peer_info, P.ClientInfo)
            if info.version != P.PROTOCOL_VERSION:
                why = f"transfer protocol {info.version} != {P.PROTOCOL_VERSION}"
                P.send_msg(sock, P.Error("protocol", why))
                raise ProtocolError("peer speaks another transfer protocol version")
            if info.watch:
                with self._lock:
                    self._watchers[sock] = threading.Lock()
                sock.settimeout(None)
                # The client never sends on a watch connection: block until it closes.
                while sock.recv(1):
                    pass
                return
            self._requests(conn)
        except (TransferError, NetError, OSError) as exc:
            if not self._closed and not isinstance(exc, (PeerDeadError, PeerClosed)):
                self._throttle.log(logging.DEBUG, "ended", "control connection ended: %r", exc)
        except Exception:  # a bug must cost one connection, never the server
            self._throttle.log(logging.ERROR, "bug", "control connection failed", exc_info=True)
        finally:
            with self._lock:
                self._conns.pop(sock, None)
                self._watchers.pop(sock, None)
                self._threads.discard(threading.current_thread())
            self._limiter.release(slot)
            with contextlib.suppress(OSError):
                sock.close()

    def _requests(self, conn: Served) -> None:
        sock = conn.sock
        cfg = self.config
        # Blocking mode with a kernel timeout tick (sockio.py): requests cost no more
        # syscalls than without deadlines, and deadlines and the idle timeout hold to a tick.
        sockio.kernel_timeouts(sock, max(0.05, min(cfg.request_timeout, cfg.idle_timeout) / 4))
        head = bytearray(4)
        while True:
            body = self._next_frame(conn, head)
            if body is None:
                return
            try:
                msg = P.decode_request(body)
            except TransferError as exc:
                # The stream cannot be trusted past a malformed request (its payload length
                # is unknown): answer, then close.
                with contextlib.suppress(OSError):
                    P.send_msg(sock, P.error_reply(exc))
                raise
            self._dispatch(conn, msg)

    def _next_frame(self, conn: Served, head: bytearray) -> bytes | None:
        """Wait (up to the idle timeout) for the next request; read its frame under a new
        request deadline. None when the client closed or stayed idle too long."""
        sock = conn.sock
        idle_until = time.monotonic() + self.config.idle_timeout
        while True:
            try:
                got = sock.recv_into(head)
                break
            except BlockingIOError:  # a tick of the idle wait
                if time.monotonic() >= idle_until:
                    return None  # the client's pool opens a new connection when needed
        if not got:
            return None
        conn.deadline = deadline = Deadline(self.config.request_timeout)
        if got < 4:
            sockio.recv_exact(sock, memoryview(head)[got:], deadline)
        size = int.from_bytes(head, "little")
        if size <= CHUNK:  # the common case (every limit is above CHUNK): one exact buffer
            body = bytearray(size)
            sockio.recv_exact(sock, memoryview(body), deadline)
            return body
        dec = FrameDecoder(self._max_frame)  # big frames: buffers grow only as bytes arrive
        try:
            frames = dec.feed(head)  # refuses an announced size above the limit, unread
        except FrameTooLarge as exc:
            with contextlib.suppress(OSError):
                P.send_msg(sock, P.error_reply(RequestTooLarge(str(exc))))
            raise
        scratch = memoryview(bytearray(CHUNK))
        while not frames:
            n = min(size - dec.buffered, CHUNK)
            sockio.recv_exact(sock, scratch[:n], deadline)  # never past the frame's end
            frames = dec.feed(scratch[:n])
        return frames[0]

    def _dispatch(self, conn: Served, msg: P.Message) -> None:
        sock = conn.sock
        handler = self._handlers.get(type(msg))
        if handler is not None:
            handler(conn, msg)
        elif isinstance(msg, P.GetSegment):
            try:
                desc, _ = self._lookup(msg.name)
            except TransferError as exc:
                P.send_msg(sock, P.error_reply(exc))
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
                P.send_msg(sock, P.error_reply(exc))
            except Exception as exc:  # a transport bug must not kill the connection silently
                self._throttle.log(
                    logging.ERROR, "call", "transport call %r failed", msg.kind[:64], exc_info=True
                )
                why = f"{msg.kind[:64]} call failed: {exc!r}"[:1000]
                P.send_msg(sock, P.Error("transfer", why))
            else:
                P.send_msg(sock, P.CallReply(reply))
        else:
            why = f"unexpected {type(msg).__name__} on a control connection"
            P.send_msg(sock, P.Error("protocol", why))
            raise ProtocolError(why)

    def end_users_of(self, region: object) -> int:
        """End the served connections whose current request holds ``region``; how many.

        ``unregister`` calls it so that a stalled peer cannot pin memory being given back:
        the blocked receive or send fails at once and the request releases the region.
        """
        with self._lock:
            socks = [c.sock for c in self._conns.values() if c.region is region]
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        return len(socks)

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
        self._accept.close()
        with contextlib.suppress(OSError):
            self._lsock.shutdown(socket.SHUT_RDWR)
        self._lsock.close()
        with self._lock:
            conns = list(self._conns)
            threads = list(self._threads)
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(2.0)


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"


class Connection:
    """One authenticated client connection (blocking socket)."""

    __slots__ = ("sock", "last_used")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.last_used = time.monotonic()

    def request(self, msg: P.Message, timeout: float) -> P.Message:
        self.sock.settimeout(timeout)
        P.send_msg(self.sock, msg)
        return self.reply(timeout)

    def reply(self, timeout: float) -> P.Message:
        self.sock.settimeout(timeout)
        msg = P.recv_msg(self.sock)
        if isinstance(msg, P.Error):
            raise error_from_code(msg.code, msg.message)
        return msg

    def stale(self, max_idle: float) -> bool:
        """Idle too long, or closed (or written to) by the server while it sat in the pool.

        Checked only after a second in the pool: a server closes idle connections after its
        idle timeout, and a connection used a moment ago costs no extra syscall.
        """
        idle = time.monotonic() - self.last_used
        if idle > max_idle:
            return True
        if idle < 1.0:
            return False
        try:
            p = select.poll()
            p.register(self.sock, select.POLLIN)
            return bool(p.poll(0))
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class PeerClient:
    """This engine's link to one remote engine: connection pool, calls, TCP data path, liveness."""

    def __init__(self, address: str, me: Identity, config: EngineConfig) -> None:
        self.address = address
        self._me = me
        self._config = config
        self._sec = security_of(config)
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
        limit = self._config.connect_timeout
        timeout = limit if timeout is None else min(timeout, limit)
        deadline = Deadline(timeout)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            if isinstance(exc, TimeoutError):
                raise TransferTimeout(
                    f"connecting to peer {self.address}: timed out after {timeout}s"
                ) from None
            raise PeerDeadError(f"cannot connect to peer {self.address}: {exc}") from None
        try:
            _tune(sock, self._config.tcp_keepalive)
            me = self._me
            hs = ClientHandshake(
                self._sec,
                P.SERVICE,
                me.engine_id,
                info=P.encode_info(P.ClientInfo(me.node_id, watch)),
                expect_server_id=self.engine_id or None,
            )
            try:
                engine_id = run_client(sock, hs, deadline)
            except AuthFailed as exc:
                raise AuthError(f"peer {self.address}: {exc}") from None
            except HandshakeError as exc:
                if exc.code == "identity":
                    raise PeerDeadError(
                        f"peer {self.address} restarted (engine {self.engine_id} is gone)"
                    ) from None
                raise ProtocolError(f"peer {self.address}: {exc}") from None
            except PeerClosed:
                raise PeerDeadError(
                    f"peer {self.address} closed the connection during the handshake"
                ) from None
            except (OSError, NetError) as exc:
                raise P.io_error(exc, f"authenticating with peer {self.address}") from None
            info = P.decode_info(hs.peer_info, P.ServerInfo)
            if info.version != P.PROTOCOL_VERSION:
                raise ProtocolError(f"peer {self.address} speaks transfer protocol {info.version}")
            self.node_id, self.engine_id, self.host_id = info.node_id, engine_id, info.host_id
            sock.settimeout(None)
            return Connection(sock)
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

        ``timeout`` bounds opening a new connection (a caller's deadline). Pooled connections
        the server may have closed (idle longer than half the idle timeout, or readable while
        idle) are dropped instead of used.
        """
        self.check_alive()
        conn = None
        while conn is None:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = self._connect(watch=False, timeout=timeout)
            elif conn.stale(self._config.idle_timeout / 2):
                conn.close()
                conn = None
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        conn.last_used = time.monotonic()
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

    def get_segment(self, name: str, timeout: float | None = None) -> SegmentDescriptor:
        return P.expect(self._call(P.GetSegment(name), timeout), P.SegmentInfo).desc

    def list_segments(self) -> list[SegmentDescriptor]:
        return P.expect(self._call(P.ListSegments()), P.SegmentList).descs

    def ping(self, timeout: float | None = None) -> float:
        """Round-trip time of one ping, in seconds."""
        t0 = time.perf_counter()
        seq = int.from_bytes(os.urandom(4), "little")
        pong = P.expect(self._call(P.Ping(seq), timeout), P.Pong)
        if pong.seq != seq:
            raise ProtocolError("ping answered with the wrong sequence number")
        return time.perf_counter() - t0

    def call(self, kind: str, payload: bytes, timeout: float | None = None) -> bytes:
        return P.expect(self._call(P.Call(kind, payload), timeout), P.CallReply).payload

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
            reason = (
                f"peer said goodbye: {msg.reason}"
                if isinstance(msg, P.Bye)
                else f"unexpected {type(msg).__name__}"
            )
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
