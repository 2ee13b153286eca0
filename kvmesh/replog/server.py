"""A replica process: a :class:`~kvmesh.replog.node.RaftNode` plus a client RPC endpoint.

Run one replica of a 3-node cluster (client port = raft port + ``--client-port-offset``)::

    python -m kvmesh.replog.server --id 1 \\
        --peers 1=127.0.0.1:7001,2=127.0.0.1:7002,3=127.0.0.1:7003 --dir /data/replog1

The example state machine is :class:`~kvmesh.replog.kvsm.KvStateMachine`; embedders pass
their own to :class:`ReplicaServer` (it needs ``query(bytes)`` for reads).

Client protocol: frames ``[len u32 LE][msgpack]`` carrying :data:`Request` structs (plus the
admin :class:`ReqSnapshot`); every
request has a ``rid`` echoed in its :class:`Response`, so requests pipeline on one
connection. Results are msgpack bytes (``Response.result``); errors carry a ``kind``
(``not_leader``, ``timeout``, ``lost``, ``dropped``, ``session``, ``command``, ``stopped``,
``bad_request``) and, for ``not_leader``, the leader's id and client address.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import struct
import sys
from typing import Any, Union

import msgspec

from .kvsm import KvStateMachine
from .node import (
    CommandError,
    NodeConfig,
    NodeStopped,
    NotLeaderError,
    ProposalLost,
    ProposalTimeout,
    RaftNode,
    ReadTimeout,
    SessionExpiredError,
    parse_peers,
)
from .transport import parse_addr
from .snapfile import SnapshotCorruptionError
from .types import ProposalDropped, RaftConfig, ReadOnlyOption, ReplogError, StorageError
from .wal import WalCorruptionError

__all__ = [
    "ReqRegister",
    "ReqSubmit",
    "ReqRead",
    "ReqStatus",
    "ReqSnapshot",
    "Request",
    "Response",
    "ReplicaServer",
    "LocalCluster",
    "free_ports",
    "main",
    "MAX_REQUEST",
]

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
MAX_REQUEST = 64 << 20


class ReqRegister(msgspec.Struct, tag=1, array_like=True, frozen=True):
    """Open an exactly-once session; result: the client id (int)."""

    rid: int


class ReqSubmit(msgspec.Struct, tag=2, array_like=True, frozen=True):
    """Apply ``body`` (a state-machine command) exactly once for ``(client_id, seq)``."""

    rid: int
    client_id: int
    seq: int
    body: bytes
    ack: int = 0


class ReqRead(msgspec.Struct, tag=3, array_like=True, frozen=True):
    """Linearizable read: read-index barrier, then ``state_machine.query(body)``."""

    rid: int
    body: bytes


class ReqStatus(msgspec.Struct, tag=4, array_like=True, frozen=True):
    """Node status (a dict), no leader needed. ``digest``: include the state machine's
    ``digest()`` (costly on a large state)."""

    rid: int
    digest: bool = False


class ReqSnapshot(msgspec.Struct, tag=5, array_like=True, frozen=True):
    """Admin: take a snapshot now; result: its index (0 if one was already running).
    ``reset_lag``: clear the event-loop lag statistics first (to measure the stall)."""

    rid: int
    reset_lag: bool = False


Request = Union[ReqRegister, ReqSubmit, ReqRead, ReqStatus, ReqSnapshot]


class Response(msgspec.Struct, array_like=True, frozen=True):
    rid: int
    ok: bool
    result: bytes = b""  # msgpack of the result when ok
    kind: str = ""
    error: str = ""
    leader_id: int = 0
    leader_addr: str = ""


_req_dec = msgspec.msgpack.Decoder(Request)
_enc = msgspec.msgpack.Encoder()


def _error_response(rid: int, e: BaseException) -> Response:
    if isinstance(e, NotLeaderError):
        return Response(rid, False, kind="not_leader", error=str(e), leader_id=e.leader_id or 0, leader_addr=e.leader_addr or "")
    if isinstance(e, (ProposalTimeout, ReadTimeout, asyncio.TimeoutError)):
        kind = "timeout"
    elif isinstance(e, ProposalLost):
        kind = "lost"
    elif isinstance(e, ProposalDropped):
        kind = "dropped"
    elif isinstance(e, SessionExpiredError):
        kind = "session"
    elif isinstance(e, CommandError):
        kind = "command"
    elif isinstance(e, NodeStopped):
        kind = "stopped"
    else:
        kind = "error"
    return Response(rid, False, kind=kind, error=f"{type(e).__name__}: {e}")


class ReplicaServer:
    """Serves the client protocol for one :class:`RaftNode`."""

    def __init__(self, node: RaftNode, listen_addr: str) -> None:
        self.node = node
        self.listen_addr = listen_addr
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()
        self._out: dict[asyncio.StreamWriter, list[bytes]] = {}

    async def start(self) -> None:
        host, port = parse_addr(self.listen_addr)
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.cancel()
        for t in list(self._conns):
            try:
                await t
            except BaseException:  # noqa: BLE001
                pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        inflight: set[asyncio.Task] = set()
        sock = writer.get_extra_info("socket")
        if sock is not None:
            import socket

            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                (n,) = _LEN.unpack(await reader.readexactly(4))
                if n > MAX_REQUEST:
                    log.warning("client request of %d bytes refused; closing", n)
                    return
                body = await reader.readexactly(n)
                try:
                    req = _req_dec.decode(body)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    self._write(writer, Response(0, False, kind="bad_request", error=str(e)))
                    continue
                if type(req) is ReqSubmit:
                    # Hot path: no task per command; the answer is written from the
                    # future's done-callback when the entry is applied.
                    try:
                        fut = self.node.propose_nowait(req.body, req.client_id, req.seq, req.ack)
                    except (ReplogError, ValueError) as e:
                        self._write(writer, _error_response(req.rid, e))
                    else:
                        fut.add_done_callback(functools.partial(self._answer, writer, req.rid))
                    if writer.transport.get_write_buffer_size() > (1 << 20):
                        await writer.drain()
                    continue
                t = asyncio.get_running_loop().create_task(self._handle(req, writer))
                inflight.add(t)
                t.add_done_callback(inflight.discard)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            for t in inflight:
                t.cancel()
            self._conns.discard(task)
            writer.close()

    def _answer(self, writer: asyncio.StreamWriter, rid: int, fut: asyncio.Future) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            try:
                resp = Response(rid, True, _enc.encode(fut.result()))
            except (TypeError, msgspec.EncodeError) as e:
                resp = Response(rid, False, kind="bad_request", error=f"result not encodable: {e}")
        elif isinstance(exc, (ReplogError, asyncio.TimeoutError)):
            resp = _error_response(rid, exc)
        else:
            resp = Response(rid, False, kind="error", error=f"{type(exc).__name__}: {exc}")
        self._write(writer, resp)

    def _write(self, writer: asyncio.StreamWriter, resp: Response) -> None:
        if writer.is_closing():
            return
        data = _enc.encode(resp)
        # Responses resolved in the same loop iteration (one applied batch) leave in one
        # send: a syscall per response would dominate the cost of small commands.
        buf = self._out.get(writer)
        if buf is None:
            buf = self._out[writer] = []
            asyncio.get_running_loop().call_soon(self._flush, writer)
        buf.append(_LEN.pack(len(data)))
        buf.append(data)

    def _flush(self, writer: asyncio.StreamWriter) -> None:
        buf = self._out.pop(writer, None)
        if buf and not writer.is_closing():
            writer.write(b"".join(buf))

    async def _handle(self, req: Any, writer: asyncio.StreamWriter) -> None:
        node = self.node
        t = type(req)
        try:
            if t is ReqRead:
                await node.read_index()
                result = node.state_machine.query(req.body)  # type: ignore[attr-defined]
            elif t is ReqRegister:
                result = await node.register_session()
            elif t is ReqSnapshot:
                if req.reset_lag:
                    node.reset_lag_stats()
                result = await node.snapshot_now()
            elif t is ReqStatus:
                result = node.status()
                digest = getattr(node.state_machine, "digest", None) if req.digest else None
                if digest is not None:
                    result["digest"] = digest()
            else:  # pragma: no cover - the decoder admits only the union
                raise TypeError(f"unknown request {t.__name__}")
            resp = Response(req.rid, True, _enc.encode(result))
        except (ReplogError, asyncio.TimeoutError) as e:
            resp = _error_response(req.rid, e)
        except Exception as e:  # noqa: BLE001 - a bad request must not kill the server
            log.warning("request %r failed: %r", req, e)
            resp = Response(req.rid, False, kind="bad_request", error=f"{type(e).__name__}: {e}")
        self._write(writer, resp)
        if writer.transport.get_write_buffer_size() > (1 << 20):
            try:
                await writer.drain()  # a client that stops reading must not grow our buffer forever
            except ConnectionError:
                pass


def client_addrs_for(peers: dict[int, str], offset: int) -> dict[int, str]:
    """Client endpoints at ``raft port + offset`` on the same hosts."""
    out = {}
    for i, a in peers.items():
        host, port = parse_addr(a)
        out[i] = f"{host}:{port + offset}"
    return out


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvmesh.replog.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--id", type=int, required=True, help="this replica's id (a key of --peers)")
    p.add_argument("--peers", required=True, help="ID=HOST:PORT,... raft addresses of all replicas")
    p.add_argument("--dir", default=None, help="data directory (required with --durability disk)")
    p.add_argument("--durability", choices=["disk", "memory"], default="disk")
    p.add_argument("--client-port-offset", type=int, default=100, help="client port = raft port + offset")
    p.add_argument("--client-addrs", default=None, help="ID=HOST:PORT,... client endpoints (overrides the offset)")
    p.add_argument("--tick-ms", type=float, default=100.0)
    p.add_argument("--election-ticks", type=int, default=10, help="min election timeout in ticks (max = 2x)")
    p.add_argument("--lease-reads", action="store_true", help="serve reads from the leader lease")
    p.add_argument("--snapshot-threshold", type=int, default=50_000)
    p.add_argument("--trailing-logs", type=int, default=10_000)
    p.add_argument("--session-ttl-s", type=float, default=0.0)
    p.add_argument("--join", action="store_true", help="do not bootstrap (member being added)")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(a: argparse.Namespace) -> NodeConfig:
    peers = parse_peers(a.peers)
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
        client_addrs=parse_peers(a.client_addrs) if a.client_addrs else client_addrs_for(peers, a.client_port_offset),
        data_dir=a.dir,
        durability=a.durability,
        join=a.join,
        tick_s=a.tick_ms / 1000.0,
        raft=raft,
        snapshot_threshold=a.snapshot_threshold,
        trailing_logs=a.trailing_logs,
        session_ttl_s=a.session_ttl_s,
    )


async def run_replica(cfg: NodeConfig, sm: Any = None) -> int:
    """Run until SIGTERM/SIGINT (exit 0) or a fatal storage error (exit 3). ``main`` exits
    4 when the data directory is damaged or locked, 5 on other start-up I/O errors."""
    node = RaftNode(cfg, sm if sm is not None else KvStateMachine())
    await node.start()
    server = ReplicaServer(node, cfg.client_addrs.get(cfg.node_id) or cfg.peers[cfg.node_id])
    await server.start()
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
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.data_dir:
        os.makedirs(cfg.data_dir, exist_ok=True)
    try:
        return asyncio.run(run_replica(cfg))
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


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` right now (all bound at once, then released)."""
    import socket

    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalCluster:
    """Replica processes on this host, for tests, benchmarks and development.

    Ports are picked free at construction; ``base_dir/N`` is replica N's data directory.
    ``extra_args`` are passed to every replica (e.g. ``["--durability", "memory"]``).
    Replica logs go to ``base_dir/replicaN.log``.
    """

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
    ) -> None:
        self.base_dir = base_dir
        os.makedirs(base_dir, exist_ok=True)
        ports = free_ports(2 * n, host)
        self.ids = list(range(1, n + 1))
        self.peers = {i: f"{host}:{ports[i - 1]}" for i in self.ids}
        self.client_addrs = {i: f"{host}:{ports[n + i - 1]}" for i in self.ids}
        self.tick_ms = tick_ms
        self.election_ticks = election_ticks
        self.extra_args = list(extra_args or [])
        self.python = python or sys.executable
        self.procs: dict[int, Any] = {}
        self.restore_s: dict[int, float] = {}

    def _spec(self, d: dict[int, str]) -> str:
        return ",".join(f"{i}={a}" for i, a in sorted(d.items()))

    def command(self, i: int) -> list[str]:
        return [
            self.python, "-m", "kvmesh.replog.server",
            "--id", str(i),
            "--peers", self._spec(self.peers),
            "--client-addrs", self._spec(self.client_addrs),
            "--dir", os.path.join(self.base_dir, str(i)),
            "--tick-ms", str(self.tick_ms),
            "--election-ticks", str(self.election_ticks),
            *self.extra_args,
        ]  # fmt: skip

    def start(self, i: int, wait: bool = True, timeout: float = 60.0) -> None:
        import subprocess

        if self.alive(i):
            raise RuntimeError(f"replica {i} is already running")
        logf = open(os.path.join(self.base_dir, f"replica{i}.log"), "ab")
        self.procs[i] = subprocess.Popen(self.command(i), stdout=subprocess.PIPE, stderr=logf, stdin=subprocess.DEVNULL)
        logf.close()
        if wait:
            self.wait_ready(i, timeout)

    def wait_ready(self, i: int, timeout: float = 60.0) -> float:
        """Wait for the replica's READY line; returns its restore time (seconds)."""
        import select
        import time

        p = self.procs[i]
        assert p.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"replica {i} not ready within {timeout}s (log: {self.log_tail(i)})")
            r, _, _ = select.select([p.stdout], [], [], min(left, 0.5))
            if r:
                line = p.stdout.readline().decode()
                if line.startswith("READY"):
                    self.restore_s[i] = float(line.split()[2])
                    return self.restore_s[i]
                if not line and p.poll() is not None:
                    raise RuntimeError(f"replica {i} exited with {p.returncode}: {self.log_tail(i)}")

    def start_all(self, timeout: float = 60.0) -> None:
        for i in self.ids:
            self.start(i, wait=False)
        for i in self.ids:
            self.wait_ready(i, timeout)

    def alive(self, i: int) -> bool:
        p = self.procs.get(i)
        return p is not None and p.poll() is None

    def signal(self, i: int, sig: int) -> None:
        p = self.procs[i]
        if p.poll() is None:
            p.send_signal(sig)

    def kill(self, i: int) -> None:
        """SIGKILL (no cleanup, like a crash) and reap."""
        p = self.procs.get(i)
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()

    def stop(self, i: int, timeout: float = 10.0) -> int | None:
        """SIGTERM and wait (SIGKILL after ``timeout``); returns the exit code."""
        import subprocess

        p = self.procs.get(i)
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.terminate()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return p.returncode

    def pause(self, i: int) -> None:
        self.signal(i, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        self.signal(i, signal.SIGCONT)

    def log_tail(self, i: int, n: int = 2000) -> str:
        try:
            with open(os.path.join(self.base_dir, f"replica{i}.log"), "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        for i in list(self.procs):
            self.kill(i)
            p = self.procs[i]
            if p.stdout is not None:
                p.stdout.close()
        self.procs.clear()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
