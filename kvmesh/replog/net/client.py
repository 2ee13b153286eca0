"""Client of a replica cluster (the protocol of :mod:`kvmesh.replog.net.server`).

:class:`ReplogClient` finds the leader itself (following ``not_leader`` redirects, trying
the next replica on connection errors and timeouts) and makes every command exactly-once:
it opens a session, numbers commands, and retries a command with the *same* sequence
number until it gets an answer, so a retry after a lost reply or a failover returns the
original result instead of applying twice.

Outcomes of :meth:`ReplogClient.submit`:

* a result: the command was applied exactly once;
* :class:`~kvmesh.replog.errors.CommandError`: the state machine rejected it (applied as a
  no-op, deterministically);
* :class:`~kvmesh.replog.errors.ProposalTimeout` after ``timeout``: unknown outcome;
* :class:`~kvmesh.replog.errors.SessionExpiredError`: unknown outcome, session gone;
* any other :class:`~kvmesh.replog.errors.ReplogError` rebuilt from the replica's error code.

Connections authenticate with :mod:`kvmesh.net` (service ``"replog-client"``); the
session token from registration travels with every command.

:class:`KvClient` adds ``put/get/delete/cas`` for :class:`~kvmesh.replog.kvsm.KvStateMachine`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from typing import Any

import msgspec

from ...net import (
    TRANSPORT_ERRORS,
    NetError,
    SecurityConfig,
    aclient_handshake,
    aread_frame,
    client_ssl_context,
    encode_frame,
)
from ...net.retry import LeaderFinder, LeaderFinderViews
from ..errors import (
    RETRYABLE,
    ClusterUnavailable,
    NotLeader,
    ProposalTimeout,
    ReadTimeout,
    error_from_code,
)
from ..kvsm import KvBatch, KvCas, KvDelete, KvGet, KvPut, encode_command
from .protocol import (
    CLIENT_SERVICE,
    MAX_RESPONSE,
    ReqRead,
    ReqRegister,
    ReqSnapshot,
    ReqStatus,
    ReqSubmit,
    Response,
    SessionGrant,
    decode_response,
    encode,
)
from .transport import parse_addr

__all__ = ["ClusterUnavailable", "KvClient", "ReplogClient"]

log = logging.getLogger(__name__)

_NOT_LEADER = NotLeader.code


class _Conn:
    """One pipelined connection to one replica."""

    def __init__(self, addr: str, security: SecurityConfig, name: str) -> None:
        self.addr = addr
        self.security = security
        self.name = name
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.waiters: dict[int, asyncio.Future] = {}
        self.task: asyncio.Task | None = None
        self.lock = asyncio.Lock()
        self.outbuf: list[bytes] | None = None

    async def ensure(self, timeout: float) -> None:
        if self.writer is not None and not self.writer.is_closing():
            return
        async with self.lock:
            if self.writer is not None and not self.writer.is_closing():
                return
            host, port = parse_addr(self.addr)
            sec = self.security
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=client_ssl_context(sec)), timeout
            )
            try:
                await aclient_handshake(reader, writer, sec, CLIENT_SERVICE, self.name, timeout)
            except NetError as e:
                writer.close()
                raise ConnectionError(f"{self.addr}: {e}") from None
            except BaseException:
                writer.close()
                raise
            sock = writer.get_extra_info("socket")
            if sock is not None:
                import socket

                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.reader, self.writer = reader, writer
            self.task = asyncio.get_running_loop().create_task(self._read_loop(reader))

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                resp = decode_response(await aread_frame(reader, MAX_RESPONSE))
                f = self.waiters.pop(resp.rid, None)
                if f is not None and not f.done():
                    f.set_result(resp)
        except asyncio.CancelledError:
            self._fail(ConnectionError(f"connection to {self.addr} closed"))
            raise
        except Exception as e:  # noqa: BLE001 - any end fails the waiters at once
            # TRANSPORT_ERRORS and undecodable replies are expected; anything else is a bug,
            # but either way the callers learn now instead of at their attempt timeout.
            if not isinstance(e, TRANSPORT_ERRORS + (msgspec.DecodeError,)):
                log.exception("replog client: reading from %s failed", self.addr)
            self._fail(ConnectionError(f"connection to {self.addr} lost: {e or type(e).__name__}"))

    def _flush(self) -> None:
        buf, self.outbuf = self.outbuf, None
        if buf and self.writer is not None and not self.writer.is_closing():
            try:
                self.writer.write(b"".join(buf))
            except TRANSPORT_ERRORS:  # uvloop: RuntimeError on a reset connection
                self.writer.transport.abort()  # the read loop ends and fails the waiters

    def _fail(self, exc: BaseException) -> None:
        self.outbuf = None
        for f in self.waiters.values():
            if not f.done():
                f.set_exception(exc)
        self.waiters.clear()
        if self.writer is not None:
            self.writer.close()
        self.writer = None

    async def call(self, req: Any, timeout: float) -> Response:
        await self.ensure(timeout)
        assert self.writer is not None
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.waiters[req.rid] = fut
        # Requests issued in the same loop iteration share one send.
        if self.outbuf is None:
            self.outbuf = []
            loop.call_soon(self._flush)
        self.outbuf.append(encode_frame(encode(req)))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.waiters.pop(req.rid, None)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except BaseException:  # noqa: BLE001
                pass
        if self.writer is not None:
            self.writer.close()
        self.writer = None


class ReplogClient(LeaderFinderViews):
    """Leader-finding, retrying, exactly-once client.

    ``addrs``: client endpoints of the replicas. ``timeout``: overall deadline of one call;
    ``attempt_timeout``: how long to wait for one replica before trying another;
    ``max_backoff``: longest pause between rounds over all replicas (no leader known);
    ``security``: the cluster token / TLS files (default: from the environment,
    :meth:`kvmesh.net.SecurityConfig.from_env`); ``name``: the id this client presents in
    the handshake (logs only).
    """

    def __init__(
        self,
        addrs: list[str] | dict[int, str],
        *,
        timeout: float = 15.0,
        attempt_timeout: float = 2.0,
        result_type: Any = Any,
        seed: int | None = None,
        max_backoff: float = 0.5,
        security: SecurityConfig | None = None,
        name: str = "replog-client",
    ) -> None:
        addr_list = list(addrs.values()) if isinstance(addrs, dict) else list(addrs)
        if not addr_list:
            raise ValueError("no replica addresses")
        self.security = security if security is not None else SecurityConfig.from_env()
        self.name = name
        self.timeout = timeout
        self.attempt_timeout = attempt_timeout
        self.max_backoff = max_backoff
        self._finder = LeaderFinder(addr_list, rng=random.Random(seed), max_backoff=max_backoff)
        self._conns = {a: self._new_conn(a) for a in addr_list}
        self._rid = itertools.count(1)
        self._result_dec = msgspec.msgpack.Decoder(result_type)
        self.client_id: int | None = None
        self._token = b""
        self._outstanding: set[int] = set()
        self._next_seq = 1

    def _new_conn(self, addr: str) -> _Conn:
        return _Conn(addr, self.security, self.name)

    def _conn(self, addr: str) -> _Conn:
        conn = self._conns.get(addr)
        if conn is None:
            conn = self._conns[addr] = self._new_conn(addr)
        return conn

    async def close(self) -> None:
        for c in self._conns.values():
            await c.close()

    async def __aenter__(self) -> ReplogClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _call(self, make_req: Any, deadline: float) -> Response:
        """Send until some replica answers something other than a retryable error."""
        self._finder.max_backoff = self.max_backoff
        tries = self._finder.attempts(deadline, self.attempt_timeout)
        while (step := tries.next()) is not None:
            addr = step.addr
            if addr is None:
                await asyncio.sleep(step.wait)
                continue
            conn = self._conn(addr)
            try:
                resp = await conn.call(
                    make_req(next(self._rid)), max(0.0, step.deadline - time.monotonic())
                )
            except TRANSPORT_ERRORS as e:
                tries.failed(addr, f"{type(e).__name__} {e}")
                continue
            if resp.ok:
                tries.succeeded(addr)
                return resp
            kind = resp.kind
            reason = f"{kind}: {resp.error}"
            if kind == _NOT_LEADER:
                tries.redirected(addr, resp.leader_addr, reason)
                continue
            if kind in RETRYABLE:
                tries.retry(addr, reason, forget_leader=kind == "stopped")
                continue
            return resp  # definite: session, command, bad_request, auth, ...
        raise ClusterUnavailable(f"no usable answer before the deadline (last: {tries.last})")

    def _decode(self, resp: Response) -> Any:
        if resp.ok:
            return self._result_dec.decode(resp.result)
        raise error_from_code(resp.kind, resp.error)

    async def register(self) -> int:
        """Open the session (done automatically by the first :meth:`submit`)."""
        deadline = time.monotonic() + self.timeout
        resp = await self._call(lambda rid: ReqRegister(rid), deadline)
        if not resp.ok:
            self._decode(resp)
        grant = msgspec.msgpack.decode(resp.result, type=SessionGrant)
        self.client_id, self._token = grant.client_id, grant.token
        return grant.client_id

    async def submit(self, body: bytes, timeout: float | None = None) -> Any:
        """Apply a state-machine command exactly once; returns its result."""
        if self.client_id is None:
            await self.register()
        seq = self._next_seq
        self._next_seq += 1
        self._outstanding.add(seq)
        cid = self.client_id
        token = self._token
        assert cid is not None
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:

            def make(rid: int) -> ReqSubmit:
                # Everything below the oldest command still in flight has been answered.
                ack = min(self._outstanding) if self._outstanding else self._next_seq
                return ReqSubmit(rid, cid, seq, body, ack, token)

            try:
                resp = await self._call(make, deadline)
            except ClusterUnavailable as e:
                raise ProposalTimeout(
                    f"command seq {seq} of client {cid}: outcome unknown ({e})"
                ) from None
            return self._decode(resp)
        finally:
            self._outstanding.discard(seq)

    async def read(self, body: bytes, timeout: float | None = None) -> Any:
        """Linearizable read (``query(body)`` on a replica after a read-index barrier)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            resp = await self._call(lambda rid: ReqRead(rid, body), deadline)
        except ClusterUnavailable as e:
            raise ReadTimeout(str(e)) from None
        return self._decode(resp)

    async def status(self, addr: str, digest: bool = False) -> dict:
        """Status of one replica (no leader needed); ``digest`` adds the state digest."""
        resp = await self._conn(addr).call(ReqStatus(next(self._rid), digest), self.attempt_timeout)
        if not resp.ok:
            self._decode(resp)
        return msgspec.msgpack.decode(resp.result)

    async def snapshot(self, addr: str, reset_lag: bool = False, timeout: float = 60.0) -> int:
        """Admin: make one replica snapshot now; returns the snapshot index."""
        resp = await self._conn(addr).call(ReqSnapshot(next(self._rid), reset_lag), timeout)
        if not resp.ok:
            self._decode(resp)
        return msgspec.msgpack.decode(resp.result, type=int)

    @property
    def leader_addr(self) -> str | None:
        return self._finder.leader


class KvClient(ReplogClient):
    """:class:`ReplogClient` for :class:`~kvmesh.replog.kvsm.KvStateMachine`."""

    def __init__(self, addrs: list[str] | dict[int, str], **kw: Any) -> None:
        kw.setdefault("result_type", Any)
        super().__init__(addrs, **kw)

    async def put(self, key: str, value: bytes) -> None:
        await self.submit(encode_command(KvPut(key, value)))

    async def delete(self, key: str) -> bool:
        return await self.submit(encode_command(KvDelete(key)))

    async def cas(self, key: str, expected: bytes | None, value: bytes) -> bool:
        return await self.submit(encode_command(KvCas(key, expected, value)))

    async def get(self, key: str) -> bytes | None:
        return await self.read(encode_command(KvGet(key)))

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        return await self.read(encode_command(KvBatch([KvGet(k) for k in keys])))

    async def batch(self, cmds: list[Any]) -> list[Any]:
        """Several commands as one log entry (one RPC, applied atomically in order)."""
        return await self.submit(encode_command(KvBatch(cmds)))
