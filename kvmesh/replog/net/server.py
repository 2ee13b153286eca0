"""A replica process: a :class:`~kvmesh.replog.node.RaftNode` plus a client RPC endpoint.

Run one replica of a 3-node cluster (client port = raft port + ``--client-port-offset``)::

    KVMESH_TOKEN_FILE=/etc/kvmesh/token python -m kvmesh.replog.net.server --id 1 \\
        --peers 1=10.0.0.1:7001,2=10.0.0.2:7001,3=10.0.0.3:7001 --dir /data/replog1

Both ports authenticate every connection with the cluster token (:mod:`kvmesh.net`; from
``--token-file``, ``KVMESH_TOKEN`` or ``KVMESH_TOKEN_FILE``); without one a replica refuses
to bind anything but loopback unless ``--allow-insecure``. ``--tls-cert/--tls-key/--tls-ca``
add (mutual) TLS on both ports.

The example state machine is :class:`~kvmesh.replog.kvsm.KvStateMachine`; embedders pass
their own to :class:`ReplicaServer` with a ``query`` function for reads. The wire protocol
is :mod:`kvmesh.replog.net.protocol`; what the port accepts is in :class:`ServerLimits`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hmac
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec

from ...launcher import ProcessCluster, free_ports
from ...net import (
    CLIENT,
    TRANSPORT_ERRORS,
    TURN_REQUESTS,
    ConnectionLimiter,
    DeadlineWatch,
    FrameDecoder,
    FrameTooLarge,
    InsecureBind,
    NetError,
    SecurityConfig,
    ServerHandshake,
    Slot,
    Watched,
    arun_server,
    check_bind,
    clip,
    encode_frame,
    eventloop,
    read_frames,
    server_ssl_context,
)
from ...net.addr import join_host_port
from ...net.identity import issue
from ...net.limits import MIN_HANDSHAKE_AGE_S
from ...net.listener import Listener, start_listener
from ...net.throttle import LogThrottle
from ..errors import (
    BadRequest,
    NotLeaderError,
    Overloaded,
    ProposalTimeout,
    ReplogError,
    SessionDenied,
    SnapshotCorruptionError,
    StorageError,
    Unauthorized,
    WalCorruptionError,
)
from ..kvsm import KvStateMachine
from ..node import NodeConfig, RaftNode, parse_peers
from ..types import RaftConfig, ReadOnlyOption, StateMachine
from .protocol import (
    CLIENT_SERVICE,
    MAX_REQUEST,
    ReqRead,
    ReqRegister,
    ReqSnapshot,
    ReqStatus,
    ReqSubmit,
    Response,
    SessionGrant,
    decode_request,
    encode,
)
from .transport import TransportConfig, parse_addr

__all__ = [
    "LocalCluster",
    "ReplicaServer",
    "ServerLimits",
    "error_response",
    "free_ports",
    "main",
]

log = logging.getLogger(__name__)

SM = TypeVar("SM", bound=StateMachine)
_MAX_TOKEN = 64


class ServerLimits(msgspec.Struct, kw_only=True, frozen=True):
    """What the client port accepts: a connection is refused (closed at once) beyond
    ``max_connections`` (``max_unauthenticated`` of them in the handshake, which must end
    within ``handshake_timeout_s``; a newcomer evicts the oldest connection still in its
    handshake, ``max_unauthenticated_per_source`` of those from one address; a newcomer
    evicts the oldest connection still in its handshake, its own source's first, see
    :class:`kvmesh.net.ConnectionLimiter`); a request frame is at most
    ``max_request`` bytes, must be complete ``frame_timeout_s`` after its first byte, and all
    connections together hold at most ``max_buffered_bytes`` of incomplete requests (the one
    that would exceed it is closed); a connection with more than ``max_inflight`` unanswered
    requests gets ``overloaded``; one without any request for ``idle_timeout_s`` (and none in
    flight) is closed."""

    max_request: int = MAX_REQUEST
    max_buffered_bytes: int = 64 << 20
    max_connections: int = 1024
    max_unauthenticated: int = 64
    max_unauthenticated_per_source: int = 32
    max_inflight: int = 4096
    handshake_timeout_s: float = 5.0
    frame_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0


def error_response(rid: int, e: BaseException) -> Response:
    """The wire form of an error (its code from :mod:`kvmesh.replog.errors`)."""
    if isinstance(e, NotLeaderError):
        return Response(
            rid,
            False,
            kind=e.code,
            error=str(e),
            leader_id=e.leader_id or 0,
            leader_addr=e.leader_addr or "",
        )
    if isinstance(e, asyncio.TimeoutError) and not isinstance(e, ReplogError):
        e = ProposalTimeout(str(e) or "timed out")
    if not isinstance(e, ReplogError):
        e = BadRequest(f"{type(e).__name__}: {e}")
    return Response(rid, False, kind=e.code, error=str(e)[:1000])


class _Client:
    """One client connection's state."""

    __slots__ = ("writer", "authenticated", "inflight", "held", "peer")

    def __init__(self, writer: asyncio.StreamWriter, authenticated: bool, peer: str) -> None:
        self.writer = writer
        self.authenticated = authenticated
        self.inflight = 0
        self.held = 0  # bytes of an incomplete request charged to the server's budget
        self.peer = peer


def _query(sm: Any, body: bytes) -> Any:
    return sm.query(body)


class ReplicaServer(Generic[SM]):
    """Serves the client protocol (:mod:`kvmesh.replog.net.protocol`) for one
    :class:`RaftNode`, whatever its state machine: reads call ``query(state_machine, body)``
    (default: the machine's own ``query`` method); results are msgpack-encoded.

    ``security``: the cluster token / TLS files (default: the node's); ``limits``:
    :class:`ServerLimits`. Admin requests (``ReqSnapshot``) need an authenticated
    connection (a token or a verified client certificate)."""

    def __init__(
        self,
        node: RaftNode,
        listen_addr: str,
        *,
        security: SecurityConfig | None = None,
        limits: ServerLimits | None = None,
        query: Callable[[SM, bytes], Any] = _query,
    ) -> None:
        self.node = node
        self.listen_addr = listen_addr
        self.security = security if security is not None else node.cfg.security
        self.limits = limits or ServerLimits()
        self.query = query
        lim = self.limits
        self._limiter = ConnectionLimiter(
            lim.max_connections,
            lim.max_unauthenticated,
            lim.max_unauthenticated_per_source,
            min_handshake_age_s=MIN_HANDSHAKE_AGE_S,
        )
        self._watch = DeadlineWatch(self.limits.idle_timeout_s, self.limits.frame_timeout_s)
        self._throttle = LogThrottle(log, 5.0)
        self._buffered = 0
        self._server: Listener | None = None
        self._conns: set[asyncio.Task] = set()
        self._clients: set[_Client] = set()
        self._out: dict[asyncio.StreamWriter, list[bytes]] = {}
        # connections refused at accept: self._limiter.refused
        self.stats = {"auth_failures": 0, "closed_bad_frames": 0, "denied": 0}

    async def start(self) -> None:
        host, port = parse_addr(self.listen_addr)
        check_bind(host, self.security)
        self._server = await start_listener(
            self._serve,
            host,
            port,
            self._limiter,
            ssl=server_ssl_context(self.security),
            greet=self._new_handshake,
        )

    def _new_handshake(self) -> ServerHandshake:
        return ServerHandshake(self.security, CLIENT_SERVICE, f"replica-{self.node.id}")

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self._watch.stop()
        for c in list(self._clients):
            c.writer.close()
        for t in list(self._conns):
            t.cancel()
        for t in list(self._conns):
            try:
                await t
            except BaseException:  # noqa: BLE001, S110 - shutting down
                pass

    def _charge(self, c: _Client, buffered: int) -> None:
        delta = buffered - c.held
        if delta > 0 and self._buffered + delta > self.limits.max_buffered_bytes:
            raise FrameTooLarge(
                f"incomplete requests would hold more than {self.limits.max_buffered_bytes} bytes"
            )
        self._buffered += delta
        c.held = buffered

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slot: Slot
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        lim = self.limits
        sec = self.security
        c: _Client | None = None
        watched: Watched | None = None
        try:
            try:
                # Begun by the listener when it greeted the connection (kvmesh.net.listener).
                hs = slot.handshake or self._new_handshake()
                peer = await arun_server(reader, writer, hs, lim.handshake_timeout_s)
            except TRANSPORT_ERRORS as e:
                self.stats["auth_failures"] += 1
                self._throttle.log(
                    logging.INFO, "auth", "client connection refused: %s", clip(str(e))
                )
                return
            if not self._limiter.authenticated(slot):
                return  # evicted for a newer connection while still in its handshake
            authenticated = sec.authenticates or (
                sec.mutual_tls and writer.get_extra_info("peercert") is not None
            )
            c = _Client(writer, authenticated, peer)
            self._clients.add(c)
            sock = writer.get_extra_info("socket")
            if sock is not None:
                import socket

                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            dec = FrameDecoder(lim.max_request)
            client = c
            # Waiting for its own answers is not idleness.
            watched = self._watch.watch(writer, dec, lambda: client.inflight > 0)
            charge = functools.partial(self._charge, c)
            turn = 0
            while True:
                bodies = await read_frames(reader, watched, charge)
                self._charge(c, dec.buffered)
                for body in bodies:
                    turn += 1
                    if turn >= TURN_REQUESTS:
                        turn = 0
                        await asyncio.sleep(0)  # let the other connections in
                    self._request(c, body)
                if writer.transport.get_write_buffer_size() > (1 << 20):
                    await writer.drain()  # a client that stops reading must not grow our buffer
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        except (TimeoutError, FrameTooLarge, NetError) as e:
            self.stats["closed_bad_frames"] += 1
            log.info("closing client connection: %s", clip(str(e)))
        except TRANSPORT_ERRORS as e:  # e.g. uvloop's RuntimeError on a reset connection
            log.info("client connection failed: %s: %s", type(e).__name__, clip(str(e)))
        except Exception:  # a bug must cost one connection, never the server
            log.exception("client connection failed")
        finally:
            if watched is not None:
                self._watch.unwatch(watched)
            if c is not None:
                self._charge(c, 0)
                self._clients.discard(c)
            self._limiter.release(slot)
            self._conns.discard(task)
            writer.close()

    def _request(self, c: _Client, body: bytes) -> None:
        try:
            req = decode_request(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._write(c.writer, error_response(0, BadRequest(clip(str(e)))))
            return
        if c.inflight >= self.limits.max_inflight:
            self._write(
                c.writer,
                error_response(
                    req.rid, Overloaded(f"more than {self.limits.max_inflight} requests in flight")
                ),
            )
            return
        if type(req) is ReqSubmit:
            # Hot path: no task per command; the answer is written from the future's
            # done-callback when the entry is applied.
            try:
                fut = self._submit(req)
            except (ReplogError, ValueError) as e:
                self._write(c.writer, error_response(req.rid, e))
            else:
                c.inflight += 1
                fut.add_done_callback(functools.partial(self._answer, c, req.rid))
            return
        c.inflight += 1
        t = asyncio.get_running_loop().create_task(self._handle(req, c))
        self._conns.add(t)
        t.add_done_callback(self._conns.discard)

    def _submit(self, req: ReqSubmit) -> asyncio.Future:
        if req.client_id <= 0 or req.seq <= 0 or req.ack < 0 or len(req.token) > _MAX_TOKEN:
            raise BadRequest("client_id and seq must be positive, ack >= 0, token <= 64 bytes")
        known = self.node.session_token(req.client_id)
        if known and not hmac.compare_digest(known, req.token):
            # Refused before it costs a log entry; the apply-time check covers sessions this
            # replica has not applied yet.
            self.stats["denied"] += 1
            raise SessionDenied(
                f"client {req.client_id}: the request does not carry the session's token"
            )
        return self.node.propose_nowait(req.body, req.client_id, req.seq, req.ack, token=req.token)

    def _answer(self, c: _Client, rid: int, fut: asyncio.Future) -> None:
        c.inflight -= 1
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            try:
                resp = Response(rid, True, encode_result(fut.result()))
            except (TypeError, msgspec.EncodeError) as e:
                resp = error_response(rid, BadRequest(f"result not encodable: {e}"))
        else:
            resp = error_response(rid, exc)
        self._write(c.writer, resp)

    def _write(self, writer: asyncio.StreamWriter, resp: Response) -> None:
        if writer.is_closing():
            return
        # Responses resolved in the same loop iteration (one applied batch) leave in one
        # send: a syscall per response would dominate the cost of small commands.
        buf = self._out.get(writer)
        if buf is None:
            buf = self._out[writer] = []
            asyncio.get_running_loop().call_soon(self._flush, writer)
        buf.append(encode_frame(encode(resp)))

    def _flush(self, writer: asyncio.StreamWriter) -> None:
        buf = self._out.pop(writer, None)
        if buf and not writer.is_closing():
            try:
                writer.write(b"".join(buf))
            except TRANSPORT_ERRORS:  # the connection died; its read loop ends it
                writer.transport.abort()

    async def _handle(self, req: Any, c: _Client) -> None:
        node = self.node
        t = type(req)
        try:
            if t is ReqRead:
                await node.read_index()
                result = self.query(node.state_machine, req.body)  # type: ignore[arg-type]
            elif t is ReqRegister:
                cid, token = await node.open_session()
                result = SessionGrant(cid, token)
            elif t is ReqSnapshot:
                if not c.authenticated:
                    raise Unauthorized(
                        "admin requests need an authenticated connection (a cluster token)"
                    )
                if req.reset_lag:
                    node.reset_lag_stats()
                result = await node.snapshot_now()
            elif t is ReqStatus:
                result = node.status()
                digest = getattr(node.state_machine, "digest", None) if req.digest else None
                if digest is not None:
                    result["digest"] = digest()
            else:  # pragma: no cover - the decoder admits only the union
                raise BadRequest(f"unknown request {t.__name__}")
            resp = Response(req.rid, True, encode_result(result))
        except (TimeoutError, ReplogError) as e:
            resp = error_response(req.rid, e)
        except Exception as e:  # noqa: BLE001 - a bad request must not kill the server
            log.warning("request %s failed: %s", t.__name__, clip(repr(e)))
            resp = error_response(req.rid, BadRequest(f"{type(e).__name__}: {clip(str(e))}"))
        finally:
            c.inflight -= 1
        self._write(c.writer, resp)


_result_enc = msgspec.msgpack.Encoder()


def encode_result(result: Any) -> bytes:
    return _result_enc.encode(result)


def client_addrs_for(peers: dict[int, str], offset: int) -> dict[int, str]:
    """Client endpoints at ``raft port + offset`` on the same hosts."""
    out = {}
    for i, a in peers.items():
        host, port = parse_addr(a)
        out[i] = join_host_port(host, port + offset)
    return out


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvmesh.replog.net.server", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--id", type=int, required=True, help="this replica's id (a key of --peers)")
    p.add_argument("--peers", required=True, help="ID=HOST:PORT,... raft addresses of all replicas")
    p.add_argument("--dir", default=None, help="data directory (required with --durability disk)")
    p.add_argument("--durability", choices=["disk", "memory"], default="disk")
    p.add_argument(
        "--client-port-offset", type=int, default=100, help="client port = raft port + offset"
    )
    p.add_argument(
        "--client-addrs",
        default=None,
        help="ID=HOST:PORT,... client endpoints (overrides the offset)",
    )
    p.add_argument("--tick-ms", type=float, default=100.0)
    p.add_argument(
        "--election-ticks", type=int, default=10, help="min election timeout in ticks (max = 2x)"
    )
    p.add_argument("--lease-reads", action="store_true", help="serve reads from the leader lease")
    p.add_argument("--snapshot-threshold", type=int, default=50_000)
    p.add_argument("--trailing-logs", type=int, default=10_000)
    p.add_argument("--session-ttl-s", type=float, default=0.0)
    p.add_argument("--join", action="store_true", help="do not bootstrap (member being added)")
    p.add_argument("--log-level", default="INFO")
    g = p.add_argument_group("security (also from KVMESH_TOKEN, KVMESH_TOKEN_FILE, KVMESH_TLS_*)")
    g.add_argument("--token-file", default=None, help="file holding the cluster shared secret")
    g.add_argument("--tls-cert", default=None, help="PEM certificate of this replica (both ports)")
    g.add_argument("--tls-key", default=None)
    g.add_argument(
        "--tls-ca", default=None, help="CA peers' and clients' certificates must chain to"
    )
    g.add_argument(
        "--allow-insecure", action="store_true", help="bind non-loopback addresses without a token"
    )
    g = p.add_argument_group("limits")
    g.add_argument(
        "--frame-timeout-s",
        type=float,
        default=10.0,
        help="a started frame must complete within this (both ports)",
    )
    g.add_argument(
        "--idle-timeout-s",
        type=float,
        default=None,
        help="close connections idle this long (default: peers 60, clients 300)",
    )
    g.add_argument(
        "--max-request-kb", type=int, default=MAX_REQUEST >> 10, help="largest client request frame"
    )
    g.add_argument(
        "--peer-max-message-mb",
        type=int,
        default=256,
        help="largest reassembled replica message (snapshots)",
    )
    return p


def security_from_args(
    a: argparse.Namespace, environ: dict[str, str] | None = None
) -> SecurityConfig:
    """The environment's :class:`SecurityConfig`, overridden by the command line."""
    env = dict(os.environ if environ is None else environ)
    if a.token_file:
        env.pop("KVMESH_TOKEN", None)
        env["KVMESH_TOKEN_FILE"] = a.token_file
    sec = SecurityConfig.from_env(env)
    over: dict[str, Any] = {}
    for name in ("tls_cert", "tls_key", "tls_ca"):
        if getattr(a, name):
            over[name] = getattr(a, name)
    if a.allow_insecure:
        over["allow_insecure"] = True
    return msgspec.structs.replace(sec, **over) if over else sec


def limits_from_args(a: argparse.Namespace) -> tuple[TransportConfig, ServerLimits]:
    msg = a.peer_max_message_mb << 20
    tr = TransportConfig(
        frame_timeout_s=a.frame_timeout_s,
        idle_timeout_s=a.idle_timeout_s or 60.0,
        max_message_bytes=msg,
        max_buffered_bytes=max(2 * msg, TransportConfig().max_buffered_bytes),
    )
    sl = ServerLimits(
        frame_timeout_s=a.frame_timeout_s,
        idle_timeout_s=a.idle_timeout_s or 300.0,
        max_request=a.max_request_kb << 10,
    )
    return tr, sl


def config_from_args(a: argparse.Namespace) -> NodeConfig:
    peers = parse_peers(a.peers)
    transport, _ = limits_from_args(a)
    raft = RaftConfig(
        election_tick=a.election_ticks,
        max_election_tick=2 * a.election_ticks,
        heartbeat_tick=1,
        read_only_option=ReadOnlyOption.LEASE_BASED if a.lease_reads else ReadOnlyOption.SAFE,
        max_committed_size_per_ready=8 << 20,
    )
    return NodeConfig(
        node_id=a.id,
        peers=peers,
        client_addrs=parse_peers(a.client_addrs)
        if a.client_addrs
        else client_addrs_for(peers, a.client_port_offset),
        data_dir=a.dir,
        durability=a.durability,
        join=a.join,
        tick_s=a.tick_ms / 1000.0,
        raft=raft,
        snapshot_threshold=a.snapshot_threshold,
        trailing_logs=a.trailing_logs,
        session_ttl_s=a.session_ttl_s,
        transport=transport,
        security=security_from_args(a),
    )


async def run_replica(cfg: NodeConfig, sm: Any = None, limits: ServerLimits | None = None) -> int:
    """Run until SIGTERM/SIGINT (exit 0) or a fatal storage error (exit 3). ``main`` exits
    2 on a bad configuration (e.g. an insecure bind), 4 when the data directory is damaged
    or locked, 5 on other start-up I/O errors."""
    client_addr = cfg.client_addrs.get(cfg.node_id) or cfg.peers[cfg.node_id]
    # Refuse an insecure bind before touching the data directory.
    check_bind(parse_addr(cfg.peers[cfg.node_id])[0], cfg.security)
    check_bind(parse_addr(client_addr)[0], cfg.security)
    node = RaftNode(cfg, sm if sm is not None else KvStateMachine())
    await node.start()
    server = ReplicaServer(node, client_addr, security=cfg.security, limits=limits)
    try:
        await server.start()
    except BaseException:
        await node.stop()
        raise
    log.info(
        "replica %d up: raft %s, clients %s, durability=%s, restored %d in %.3fs",
        cfg.node_id,
        cfg.peers[cfg.node_id],
        server.listen_addr,
        cfg.durability,
        node.applied_index,
        node.restore_s,
    )
    print(f"READY {cfg.node_id} {node.restore_s:.6f}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = loop.create_task(stop.wait())
    dead = loop.create_task(node.wait_stopped())
    await asyncio.wait([waiter, dead], return_when=asyncio.FIRST_COMPLETED)
    await server.stop()
    await node.stop()
    waiter.cancel()
    return 3 if node.fatal_error is not None else 0


def main(argv: list[str] | None = None) -> int:
    a = build_arg_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, a.log_level.upper(), logging.INFO),
        format=f"%(asctime)s replica{a.id} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        cfg = config_from_args(a)
        _, limits = limits_from_args(a)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.data_dir:
        os.makedirs(cfg.data_dir, exist_ok=True)
    try:
        return eventloop.run(run_replica(cfg, limits=limits))  # KVMESH_EVENT_LOOP
    except InsecureBind as e:
        print(f"error: replica {cfg.node_id}: {e}", file=sys.stderr)
        return 2
    except (StorageError, WalCorruptionError, SnapshotCorruptionError) as e:
        # Fail stop with a clear message: a damaged or busy data directory is never
        # "repaired" by guessing. Wipe it to rejoin as a fresh replica (it catches up).
        log.critical("replica %d refuses to start: %s", cfg.node_id, e)
        print(f"error: replica {cfg.node_id} refuses to start: {e}", file=sys.stderr)
        return 4
    except OSError as e:
        log.critical("replica %d cannot start: %s", cfg.node_id, e)
        print(f"error: replica {cfg.node_id} cannot start: {e}", file=sys.stderr)
        return 5


if __name__ == "__main__":
    sys.exit(main())


class LocalCluster(ProcessCluster):
    """Replica processes on this host, for tests, benchmarks and development.

    Ports are picked free at construction; ``base_dir/N`` is replica N's data directory.
    ``extra_args`` are passed to every replica (e.g. ``["--durability", "memory"]``);
    ``token``: the cluster secret (written to ``base_dir/token``; clients use
    ``security``).
    Replica logs go to ``base_dir/replicaN.log``. Start/stop/kill/pause: the shared
    :class:`kvmesh.launcher.ProcessCluster`.
    """

    role = "replica"

    def __init__(
        self,
        base_dir: str,
        n: int = 3,
        *,
        tick_ms: float = 100.0,
        election_ticks: int = 10,
        extra_args: list[str] | None = None,
        host: str = "127.0.0.1",
        python: str | None = None,
        token: str | None = None,
    ) -> None:
        super().__init__(base_dir, list(range(1, n + 1)))
        # With a token, replicas read it from a 0600 file (never from argv: ps shows argv);
        # clients use ``self.security`` (the secret: an operator's) or ``client_security``
        # (a client credential derived from it, what an application gets).
        self.security = SecurityConfig(token=token)
        self.client_security = (
            SecurityConfig(credential=issue(token, CLIENT)) if token is not None else self.security
        )
        self.token_file: str | None = None
        if token is not None:
            self.token_file = os.path.join(base_dir, "token")
            fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token)
        ports = free_ports(2 * n, host)
        self.peers = {i: join_host_port(host, ports[i - 1]) for i in self.ids}
        self.client_addrs = {i: join_host_port(host, ports[n + i - 1]) for i in self.ids}
        self.tick_ms = tick_ms
        self.election_ticks = election_ticks
        self.extra_args = list(extra_args or [])
        self.python = python or sys.executable
        self.restore_s: dict[int, float] = {}

    def command(self, i: int) -> list[str]:
        return [
            self.python, "-m", "kvmesh.replog.net.server",
            "--id", str(i),
            "--peers", self._spec(self.peers),
            "--client-addrs", self._spec(self.client_addrs),
            "--dir", os.path.join(self.base_dir, str(i)),
            "--tick-ms", str(self.tick_ms),
            "--election-ticks", str(self.election_ticks),
            *(["--token-file", self.token_file] if self.token_file else []),
            *self.extra_args,
        ]  # fmt: skip

    def on_ready(self, i: int, line: str) -> float:
        """``READY <id> <restore seconds>``: records and returns the restore time."""
        self.restore_s[i] = float(line.split()[2])
        return self.restore_s[i]

    def wait_ready(self, i: int, timeout: float = 60.0) -> float:
        """Wait for the replica's READY line; returns its restore time (seconds)."""
        return super().wait_ready(i, timeout)
