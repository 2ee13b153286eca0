"""The blocking, thread-safe connection of clients and storage nodes to the master group.

:class:`MasterClient` finds the leader itself (following :class:`~.protocol.Redirect`,
trying the next replica on connection errors and timeouts), keeps a small pool of
authenticated connections per replica (threads never share one in-flight), and makes every
mutating request exactly-once: it opens a replog session, numbers requests, and retries a
request with the *same* ``seq`` until it gets an answer. After ``timeout`` seconds of
failures a call raises :class:`~.errors.StoreUnavailable` (for a mutation: outcome unknown).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from ..net import framing as _framing
from ..net.addr import split_host_port
from ..net.errors import AuthFailed, NetError
from ..net.handshake import client_handshake
from ..net.limits import Deadline
from ..net.retry import LeaderFinder, LeaderFinderViews
from ..net.security import SecurityConfig, client_ssl_context
from . import errors as E
from . import protocol as P

__all__ = ["MasterClient", "reply_error", "session_lost"]

log = logging.getLogger(__name__)

_MAX_RESPONSE = 256 << 20  # replies of big batches (replica lists) are larger than requests


class _Conn:
    __slots__ = ("addr", "sock")

    def __init__(self, addr: str, sock: socket.socket) -> None:
        self.addr = addr
        self.sock = sock

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class MasterClient(LeaderFinderViews):
    """``addrs``: store RPC addresses of the master replicas (any subset that includes a
    live one). ``node_id``: given, this client authenticates as storage node ``node_id``
    (the secret or that node's credential, ``kvmesh keys node ID``), which mounting,
    unmounting and heartbeating that node require; else as a client. ``timeout``: the
    longest one call keeps retrying; ``attempt_timeout``: how
    long one replica gets to answer one attempt. ``spin_us``: how long a call busy-polls
    for the master's reply before it blocks (default ``$KVMESH_SPIN_US`` or
    :data:`~kvmesh.net.framing.DEFAULT_SPIN_US`; 0 turns it off; see docs/store.md)."""

    def __init__(
        self,
        addrs: list[str],
        security: SecurityConfig | None = None,
        *,
        name: str = "store-client",
        node_id: str | None = None,
        timeout: float = 15.0,
        attempt_timeout: float = 5.0,
        max_pool: int = 8,
        spin_us: float | None = None,
    ) -> None:
        if not addrs:
            raise ValueError("no master addresses")
        for a in addrs:
            split_host_port(a)  # a bad one is refused here, not at the first call's connect
        if security is not None and not isinstance(security, SecurityConfig):
            raise TypeError(f"security must be a SecurityConfig, got {security!r}")
        # Pauses between rounds over the replicas (no leader known: an election) grow to at
        # most 0.1 s, not the finder's default 0.5 s: a round is one small RPC per replica,
        # answered at once, and after a leader kill the walk's pause was the part of the
        # store's write pause beyond the election (up to 0.45 s, docs/replog.md failover).
        self._finder = LeaderFinder(
            list(dict.fromkeys(addrs)), learn_redirects=True, max_backoff=0.1
        )
        self.sec = security if security is not None else SecurityConfig.from_env()
        self._ssl = client_ssl_context(self.sec)
        # Unique per client: the master binds our session to this authenticated name. A
        # storage node's client speaks as "node <node_id>" (its credential's), the only
        # identity the master lets mount, unmount and heartbeat that node.
        self.node_id = node_id
        self.role = "client" if node_id is None else "node"
        self.name = f"{name}-{secrets.token_hex(6)}" if node_id is None else node_id
        self.timeout = timeout
        self.attempt_timeout = attempt_timeout
        self.max_pool = max_pool
        self.spin = _framing.spin_budget(spin_us)  # seconds
        self._lock = threading.Lock()
        self._pool: dict[str, list[_Conn]] = {}
        self._rid = itertools.count(1)
        self._seq = itertools.count(1)
        self._outstanding: set[int] = set()
        self._client_id: int | None = None
        self._reg_lock = threading.Lock()
        self._closed = False

    # ----------------------------------------------------------------- connections

    def _connect(self, addr: str, deadline: float) -> _Conn:
        host, port = split_host_port(addr)
        left = max(0.01, deadline - time.monotonic())
        sock = socket.create_connection((host, port), timeout=left)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=host)
            client_handshake(
                sock,
                self.sec,
                P.SERVICE,
                self.name,
                max(0.01, deadline - time.monotonic()),
                role=self.role,  # type: ignore[arg-type]
            )
        except BaseException:
            sock.close()
            raise
        return _Conn(addr, sock)

    def _take(self, addr: str, deadline: float) -> _Conn:
        with self._lock:
            if self._closed:
                raise E.StoreUnavailable("the store client is closed")
            idle = self._pool.get(addr)
            if idle:
                return idle.pop()
        return self._connect(addr, deadline)

    def _give(self, conn: _Conn) -> None:
        with self._lock:
            idle = self._pool.setdefault(conn.addr, [])
            if not self._closed and len(idle) < self.max_pool:
                idle.append(conn)
                return
        conn.close()

    def _exchange(self, addr: str, req: Any, deadline: float) -> tuple[Any, float]:
        """``req``'s reply from ``addr`` and the time (monotonic) just before it was sent."""
        conn = self._take(addr, deadline)
        ok = False
        try:
            conn.sock.settimeout(max(0.01, deadline - time.monotonic()))
            sent = time.monotonic()
            conn.sock.sendall(_framing.encode_frame(P.encode(req)))
            while True:
                body = _framing.read_frame(
                    conn.sock, _MAX_RESPONSE, Deadline(deadline - time.monotonic()), spin=self.spin
                )
                resp = P.decode_response(body)
                if resp.rid == req.rid:
                    ok = True
                    return resp, sent
                # A stale reply of an attempt we gave up on: skip it.
        finally:
            if ok:
                self._give(conn)
            else:
                conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools, self._pool = self._pool, {}
        for idle in pools.values():
            for c in idle:
                c.close()

    # ---------------------------------------------------------------------- calls

    def call(self, make: Callable[[int], Any], *, timeout: float | None = None) -> Any:
        """Send ``make(rid)`` until a replica answers definitely; returns the reply (never a
        Redirect or a retryable ErrorResp). Raises StoreUnavailable after the deadline."""
        return self.call_timed(make, timeout=timeout)[0]

    def call_timed(
        self, make: Callable[[int], Any], *, timeout: float | None = None
    ) -> tuple[Any, float]:
        """:meth:`call`, and when the attempt that was answered left (monotonic): what a
        lease in the reply is counted from. Not the first attempt's time: after attempts
        lost to an outage that would count the outage against a lease granted afterwards
        (every read of a fresh copy then answered LeaseExpired)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        tries = self._finder.attempts(deadline, self.attempt_timeout)
        while (step := tries.next()) is not None:
            addr = step.addr
            if addr is None:
                time.sleep(step.wait)
                continue
            try:
                resp, sent = self._exchange(addr, make(next(self._rid)), step.deadline)
            except (OSError, NetError, msgspec.DecodeError, msgspec.ValidationError) as e:
                tries.failed(addr, f"{type(e).__name__}: {str(e)[:200]}")
                if isinstance(e, AuthFailed):
                    # Retrying cannot help; the master is not at fault (wrong token).
                    raise E.StoreUnavailable(
                        f"master {addr} refused our credentials: {e}"
                    ) from None
                continue
            t = type(resp)
            if t is P.Redirect:
                tries.redirected(addr, resp.leader_addr, "not the leader")
                continue
            if t is P.ErrorResp and resp.retry:
                tries.retry(addr, resp.message[:200])
                continue
            tries.succeeded(addr)
            return resp, sent
        raise E.StoreUnavailable(f"no master answered in time (last: {tries.last})")

    def _session(self) -> int:
        cid = self._client_id
        if cid is not None:
            return cid
        with self._reg_lock:
            if self._client_id is None:
                resp = self.call(lambda rid: P.RegisterReq(rid))
                if type(resp) is not P.RegisterResp:
                    raise reply_error(resp)
                self._client_id = resp.client_id
            return self._client_id

    def mutate(self, make: Callable[[int, P.Session], Any], *, timeout: float | None = None) -> Any:
        """A mutating request, exactly once: ``make(rid, session)``; retries reuse the seq."""
        for attempt in range(2):
            cid = self._session()
            with self._lock:
                seq = next(self._seq)
                self._outstanding.add(seq)
            try:

                def build(rid: int, seq: int = seq, cid: int = cid) -> Any:
                    with self._lock:
                        ack = min(self._outstanding) if self._outstanding else seq
                    return make(rid, P.Session(cid, seq, ack))

                try:
                    resp = self.call(build, timeout=timeout)
                except E.StoreUnavailable as e:
                    raise E.StoreUnavailable(
                        f"{e} (the outcome of this change is unknown)"
                    ) from None
            finally:
                with self._lock:
                    self._outstanding.discard(seq)
            if type(resp) is P.ErrorResp and session_lost(resp):
                # The master forgot our session (e.g. a memory-mode master restarted). The
                # command was not applied now; open a new session and send it again once.
                # (Not after result_evicted: that seq may have been applied once already.)
                with self._reg_lock:
                    if self._client_id == cid:
                        self._client_id = None
                if attempt == 0:
                    continue
            return resp
        return resp

    def status(self, addr: str, timeout: float = 5.0) -> dict[str, Any]:
        resp, _ = self._exchange(addr, P.StatusReq(next(self._rid)), time.monotonic() + timeout)
        if type(resp) is not P.StatusResp:
            raise reply_error(resp)
        return resp.info

    @property
    def leader(self) -> str | None:
        return self._finder.leader


def reply_error(resp: Any) -> E.StoreError:
    """The error a reply stands for when it is not the answer asked for: an ErrorResp's
    code as its class, any other reply (a broken or forged master) a StoreError."""
    if type(resp) is P.ErrorResp:
        return E.error_for(resp.code, resp.message)
    return E.StoreError(f"unexpected reply {type(resp).__name__}")


def session_lost(resp: P.ErrorResp) -> bool:
    """Whether the master answered that it forgot our session (the command was not applied:
    a new session may send it again), by its code. An evicted result (the seq may have been
    applied once) comes as StoreUnavailable and is never retried."""
    return resp.code == E.Code.SESSION_EXPIRED
