"""The store master: one replica of a 1/3/5-replica group.

A replica is a :class:`~kvmesh.replog.RaftNode` (durable data directory, or memory mode)
running :class:`~kvmesh.store.master.state.StoreStateMachine`, plus an asyncio RPC server
(:mod:`kvmesh.store.protocol` over :mod:`kvmesh.net` frames and handshake) and, while this
replica leads, a ticker that proposes the time-driven commands (reclaim of stale PROCESSING
objects, expiry of silent storage nodes, eviction) with the leader's ``now``.

Who decides what:

* the pure core (``kvmesh.store.master``) decides everything about objects, segments and
  allocation inside ``apply`` -- this module only builds commands and proposes them;
* leases, access statistics and node heartbeats are leader soft state (``master.leases``):
  reads are served by the leader after a read-index barrier, without a log entry, and grant
  leases there; Remove and Evict consult the leases *before* proposing, and keys with a
  removal in flight get no new leases. A new leader treats everything as leased for one
  lease period (``on_leader_change``), because the old leader's leases are unknown to it;
* every mutating request is one RPC and one log entry, proposed under the client's
  exactly-once session (``client_id``/``seq``): a retried request returns the first result.

Server hardening: the handshake runs before anything is allocated for a connection
(connection limiter with a separate cap on unauthenticated connections, pre-auth frames of
a few KiB), then frames are capped at ``max_frame``, batches at ``max_batch_keys`` keys,
requests in flight per connection at ``max_inflight``, and an idle connection is closed after
``idle_timeout_s``. Replies are bounded (``max_reply_bytes`` of replica descriptors) and
written one at a time; a peer that leaves more than 1 MiB of them unread for
``request_timeout_s`` is disconnected, as is one whose begun request frame does not end within
it. A connection that sends junk is closed; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
import numpy as np

from ..net import eventloop
from ..net import framing as _framing
from ..net.addr import parse_peers, split_host_port
from ..net.deadlines import TURN_REQUESTS, DeadlineWatch, Watched, read_frames
from ..net.errors import TRANSPORT_ERRORS
from ..net.handshake import ServerHandshake, arun_server
from ..net.identity import speaks_for_node
from ..net.limits import MIN_HANDSHAKE_AGE_S, ConnectionLimiter, Slot
from ..net.listener import Listener, start_listener
from ..net.security import SecurityConfig, check_bind, server_ssl_context
from ..net.throttle import LogThrottle
from ..replog import (
    CommandError,
    NodeConfig,
    NodeStopped,
    NotLeaderError,
    ProposalTimeout,
    ProposalTooLarge,
    RaftConfig,
    RaftNode,
    ReadOnlyOption,
    ReadTimeout,
    ReplogError,
    SessionExpiredError,
    SessionLimits,
    SessionRejected,
)
from . import errors as E
from . import protocol as P
from .master import commands as C
from .master.eviction import choose_victims
from .master.leases import AccessStats, LeaseTable, TermStart
from .master.liveness import LivenessJudge, default_max_gap, node_capacity
from .master.objects import State
from .master.policy import (
    HoldTracker,
    PutAges,
    plan_remove,
    plan_remove_prefix,
    plan_upsert,
)
from .master.state import StoreStateMachine
from .types import (
    MAX_BATCH_KEYS,
    MAX_OBJECT_SIZE,
    MAX_REPLICAS,
    bad_key,
    bad_parts,
    key_error,
    replica_lists,
)

__all__ = ["MasterService", "ServiceConfig", "main", "run_master"]

log = logging.getLogger(__name__)


class ServiceConfig(msgspec.Struct, kw_only=True, frozen=True):
    """One master replica (driver settings; the replicated core has its own
    :class:`~kvmesh.store.master.state.MasterConfig`).

    ``peers``: raft address of every replica (this one included); ``addrs``: store RPC
    address of every replica (the ones clients and redirects use). A single replica needs
    neither: ``ServiceConfig(listen="127.0.0.1:0", durability="memory")``.
    """

    node_id: int = 1
    peers: dict[int, str] = {}
    addrs: dict[int, str] = {}
    listen: str | None = None  # default: addrs[node_id]
    data_dir: str | None = None
    durability: Literal["disk", "memory"] = "disk"
    tick_s: float = 0.05
    election_ticks: int = 10
    lease_reads: bool = True  # read barrier from the raft leader lease when it holds one
    snapshot_threshold: int = 50_000
    # a graceful stop snapshots first, so the next start restores the image instead of
    # replaying the log since the last snapshot (a batch entry holds thousands of keys)
    snapshot_on_stop: bool = True
    # also snapshot after this many keys applied since the last one (a restart after a
    # crash replays at most about that many keys; snapshot_threshold counts entries)
    snapshot_keys: int = 500_000
    session_ttl_s: float = 3600.0  # client sessions idle this long are expired (log entry)
    # live client sessions (a registration beyond it ends the least recently used one) and
    # the bounds on their cached unacknowledged results (kvmesh.replog.session)
    session_limits: SessionLimits = SessionLimits()
    # store policy (leader soft state and ticker)
    lease_ttl_s: float = 5.0
    put_timeout_s: float = 60.0  # PROCESSING objects older than this are reclaimed
    node_ttl_s: float = 10.0  # storage nodes silent for this long are unmounted
    # Node liveness is judged over time the leader could hear (master/liveness.py): a node
    # silent for node_ttl_s is suspect, and expired after node_suspect_s more (0: half the
    # TTL) with the leader running throughout; a gap over liveness_max_gap_s between two of
    # the leader's own observations is a stall (0: min(TTL/4, max(1 s, 4 ticker turns)));
    # one expiry round drops at most expire_max_fraction of the nodes and of their bytes.
    node_suspect_s: float = 0.0
    liveness_max_gap_s: float = 0.0
    expire_max_fraction: float = 0.5
    ticker_s: float = 0.25
    high_watermark: float = 0.90
    evict_ratio: float = 0.05
    # objects in the master at most (PROCESSING included; 0: no cap): eviction starts at
    # high_watermark of it as for bytes, and new keys of a put beyond it answer NoSpace
    max_objects: int = 0
    # server limits
    max_frame: int = 8 << 20
    max_batch_keys: int = 8192
    max_connections: int = 1024
    max_unauthenticated: int = 64
    max_unauthenticated_per_source: int = 32  # of those, from one address (IPv6: one /64)
    max_inflight: int = 64
    # replica descriptors of one GetReplicas reply (later keys answer InvalidParams)
    max_reply_bytes: int = 8 << 20
    # mounted segments in the pool (placement scans them on every put); more are refused
    max_segments: int = 1024
    # keys one remove-by-prefix round removes at most (one log entry; the client loops)
    prefix_round_keys: int = 8192
    handshake_timeout_s: float = 5.0
    idle_timeout_s: float = 600.0
    request_timeout_s: float = 10.0
    metrics_port: int = 0  # serve Prometheus metrics on 127.0.0.1:PORT (0: off)

    def __post_init__(self) -> None:
        if self.lease_ttl_s <= 0 or self.put_timeout_s <= 0 or self.node_ttl_s <= 0:
            raise ValueError("lease_ttl_s, put_timeout_s and node_ttl_s must be positive")
        if self.max_objects < 0:
            raise ValueError("max_objects must not be negative (0: no cap)")
        if self.node_suspect_s < 0 or self.liveness_max_gap_s < 0:
            raise ValueError("node_suspect_s and liveness_max_gap_s must not be negative")
        if not 0.0 < self.expire_max_fraction <= 1.0:
            raise ValueError("expire_max_fraction must be in (0, 1]")
        if not 0.0 < self.high_watermark <= 1.0 or not 0.0 < self.evict_ratio <= 1.0:
            raise ValueError("high_watermark and evict_ratio must be in (0, 1]")
        if not 0 < self.prefix_round_keys <= MAX_BATCH_KEYS:
            raise ValueError(f"prefix_round_keys must be in 1..{MAX_BATCH_KEYS}")
        if not 0 < self.max_batch_keys <= MAX_BATCH_KEYS or self.max_frame < 4096:
            raise ValueError(
                f"max_batch_keys must be in 1..{MAX_BATCH_KEYS} and max_frame at least 4096"
            )


def _raft_config(cfg: ServiceConfig) -> RaftConfig:
    return RaftConfig(
        election_tick=cfg.election_ticks,
        max_election_tick=2 * cfg.election_ticks,
        heartbeat_tick=1,
        check_quorum=True,
        read_only_option=ReadOnlyOption.LEASE_BASED if cfg.lease_reads else ReadOnlyOption.SAFE,
        max_committed_size_per_ready=8 << 20,
    )


class _Echoed(msgspec.Struct, array_like=True, frozen=True):
    """What the log applies for a request: the core command plus what the driver decided
    before proposing it (``codes``: per-key answers given without the log, e.g.
    ObjectHasLease; ``release_at``/``proposer``: when the bytes held by a forced remove may
    be released, on the proposing leader's clock). The session table caches the whole
    result, so a retried request gets the *first* attempt's decisions back and its reply is
    rebuilt exactly as the first time."""

    body: bytes
    codes: list[int] = []
    release_at: float = 0.0
    proposer: str = ""


class _EchoResult(msgspec.Struct, array_like=True, frozen=True):
    codes: list[int]
    result: Any


_echo_enc = msgspec.msgpack.Encoder()
_echo_dec = msgspec.msgpack.Decoder(_Echoed)


class _EchoMachine:
    """Thin wrapper between the replog's session machine and the pure core: unwraps
    :class:`_Echoed`, returns :class:`_EchoResult`, and reports hold removes (their log
    index is the hold's tag) to ``on_hold``. Snapshots are the core's own."""

    def __init__(self, inner: StoreStateMachine) -> None:
        self.inner = inner
        self.result_type = _make_result_type(getattr(inner, "result_type", Any))
        self.on_hold: Any = None
        self.term_start: TermStart | None = None  # this replica's leadership, if it leads

    def apply(self, index: int, data: bytes) -> Any:
        ts = self.term_start
        if ts is not None:
            ts.observe(index, self.inner.processing)
        env = _echo_dec.decode(data)
        res = self.inner.apply(index, env.body)
        if env.release_at and self.on_hold is not None:
            self.on_hold(index, env.release_at, env.proposer)
        return _EchoResult(env.codes, res)

    def snapshot(self) -> bytes:
        return self.inner.snapshot()

    def snapshot_chunks(self) -> Any:
        chunks = getattr(self.inner, "snapshot_chunks", None)
        return chunks() if chunks is not None else iter((self.inner.snapshot(),))

    def restore(self, data: bytes) -> None:
        self.inner.restore(data)


def _make_result_type(inner_rt: Any) -> Any:
    if inner_rt is Any:
        return _EchoResult
    return msgspec.defstruct(
        "EchoResultT", [("codes", list[int]), ("result", inner_rt)], array_like=True, frozen=True
    )


_LEASE_READS = (P.GetReplicasReq, P.ExistsReq, P.ExistsPartsReq, P.GetSizeReq)
# Reads this small are answered inline (latency); bigger ones run as tasks, so that requests
# buffered on one connection never hold the event loop for long.
_INLINE_KEYS = 512
_MAX_NAME = 256  # node ids, segment names, endpoints, host ids
_MAX_OWNERS = 65536  # session -> peer bindings kept by a leader
_MAX_WRITERS = 1 << 20  # put -> writer session bindings kept by a leader
_SCAN_SLICE = 4096  # keys a remove by prefix scans between yields to the event loop
_ROUND_KEY_BYTES = 1 << 20  # key bytes of one remove-by-prefix entry (then another round)
# Remove-by-prefix scans queued or running on a master (one per connection at a time); past
# it a round is answered busy (retryable) at once: each scan costs the whole table.
MAX_SCANS = 16


class _Busy(E.StoreUnavailable):
    """A bounded queue of this master is full: the request did nothing, retry it."""


_NEVER = float("inf")  # Reclaim's put timeout: stale puts are revoked by version instead


class _Fields(frozenset):
    """The fields of a request type that :meth:`MasterService._check` looks at."""

    counted: tuple[str, ...]
    names: tuple[str, ...]


_FIELDS: dict[type, _Fields] = {}


def _checked_fields(t: type) -> _Fields:
    """Which checked fields request type ``t`` has, worked out once per type (per request
    this was a dozen ``getattr`` probes, a fifth of a single-key lookup's checks)."""
    f = _FIELDS.get(t)
    if f is None:
        have = set(getattr(t, "__struct_fields__", ()))
        f = _Fields(have)
        f.counted = tuple(n for n in ("sizes", "versions") if n in have)
        f.names = tuple(n for n in ("node_id", "segment", "endpoint", "host_id") if n in have)
        _FIELDS[t] = f
    return f


def _now() -> float:
    """The leader's wall clock for commands (pins' TTLs, drain deadlines, the segment-name
    quarantine): nothing that frees memory a reader or writer may still use depends on it
    (docs/store-master.md, "Clocks")."""
    return time.time()


class MasterService:
    """One master replica: create, ``await start()``, serve, ``await stop()``."""

    def __init__(self, config: ServiceConfig, security: SecurityConfig | None = None) -> None:
        self.cfg = config
        self.sec = security if security is not None else SecurityConfig.from_env()
        listen = config.listen or config.addrs.get(config.node_id)
        if not listen:
            raise ValueError("ServiceConfig needs listen or addrs[node_id]")
        host, _ = split_host_port(listen)
        check_bind(host, self.sec)
        self._listen = listen
        self.sm = StoreStateMachine()
        self._machine = _EchoMachine(self.sm)
        self.node: RaftNode | None = None
        self.address = ""
        self.server_id = f"store-master-{config.node_id}-{secrets.token_hex(4)}"
        self._server: Listener | None = None
        self._limiter = ConnectionLimiter(
            config.max_connections,
            config.max_unauthenticated,
            config.max_unauthenticated_per_source,
            min_handshake_age_s=MIN_HANDSHAKE_AGE_S,
        )
        self._conns: set[asyncio.Task] = set()
        self._throttle = LogThrottle(log, 5.0)  # refused handshakes: a line per interval
        # A begun request frame must end within request_timeout_s and within the idle bound
        # (which also bounds the wait for the next request), as one asyncio.timeout did.
        self._watch = DeadlineWatch(
            config.idle_timeout_s, min(config.request_timeout_s, config.idle_timeout_s)
        )
        self._ticker: asyncio.Task | None = None
        self._observer: asyncio.Task | None = None
        self._snap_task: asyncio.Task | None = None
        self._keys_at_snapshot = 0
        # Leader soft state (rebuilt by _on_leader_change). Leases and heartbeats run on
        # this process's monotonic clock; commands carry wall time (_now).
        self.leases = LeaseTable(start=time.monotonic(), grace=config.lease_ttl_s)
        self.term_start = TermStart(1 << 62)  # nothing is fresh before we lead
        self.liveness = _judge(config, time.monotonic())
        self.stats = AccessStats()
        self.holds = HoldTracker(self.cfg.lease_ttl_s)
        self.put_ages = PutAges()
        self._machine.on_hold = self._on_hold
        self._removing_all = 0  # RemoveAll proposals in flight: no new leases at all
        # One remove-by-prefix scan at a time: each holds a copy of the whole key list, so
        # concurrent requests (up to max_connections x max_inflight) would multiply it.
        self._scan_lock = asyncio.Lock()
        self._scans = 0  # queued or running (MAX_SCANS)
        # session -> authenticated peer id (leader soft state; the oldest bindings are
        # forgotten past _MAX_OWNERS and re-bound on next use)
        self._owners: OrderedDict[int, str] = OrderedDict()
        # storage node id -> the peer that mounted it (same rules as _owners)
        self._node_owners: OrderedDict[str, str] = OrderedDict()
        # version (log index) of a put this leader answered -> the session that started it.
        # One entry per PutStart entry, not per key: every key an entry places has its
        # index as version, so the version names the writer. Kept for two put timeouts
        # (_writer_times, oldest first; the put is reclaimed by then), at most _MAX_WRITERS.
        self._writers: dict[int, int] = {}
        self._writer_times: deque[tuple[float, int]] = deque()
        # Per-key answers decided before proposing, per (client, seq): a retry reaching this
        # leader again reuses them (after a failover the log's cached result carries them).
        self._plans: OrderedDict[tuple[int, int], tuple[list[int], float]] = OrderedDict()
        self.counters: dict[str, int] = {}
        self._suspects: list[str] = []
        self._objects_pending = 0  # new keys of PutStart proposals not applied yet
        self._last_expiry = 0.0  # heard time of this leader's last expiry round
        self.metrics: Any = None
        self.status_cache: dict[str, Any] = {}
        self.hits = 0
        self.misses = 0

    # ---------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        cfg = self.cfg
        host, port = split_host_port(self._listen)
        tls = server_ssl_context(self.sec)  # optional mutual TLS under the handshake
        self._server = await start_listener(
            self._serve,
            host,
            port,
            self._limiter,
            limit=1 << 16,
            ssl=tls,
            ssl_handshake_timeout=cfg.handshake_timeout_s if tls is not None else None,
        )
        bound = self._server.sockets[0].getsockname()
        self.address = f"{host}:{bound[1]}"
        peers = dict(cfg.peers) or {cfg.node_id: _free_addr(host)}
        addrs = dict(cfg.addrs)
        addrs[cfg.node_id] = self.address
        ncfg = NodeConfig(
            node_id=cfg.node_id,
            peers=peers,
            client_addrs=addrs,
            data_dir=cfg.data_dir,
            durability=cfg.durability,
            tick_s=cfg.tick_s,
            raft=_raft_config(cfg),
            snapshot_threshold=cfg.snapshot_threshold,
            session_ttl_s=cfg.session_ttl_s,
            session_limits=cfg.session_limits,
            proposal_timeout_s=cfg.request_timeout_s,
            read_timeout_s=min(cfg.request_timeout_s, cfg.lease_ttl_s),
            security=self.sec,  # the replica port authenticates with the same cluster token
        )
        # Snapshots from the leader are proven on a fresh machine before they are persisted.
        self.node = RaftNode(
            ncfg, self._machine, state_machine_factory=lambda: _EchoMachine(StoreStateMachine())
        )
        self.node.on_leader_change(self._on_leader_change)
        try:
            await self.node.start()
        except BaseException:
            self._server.close()
            raise
        self._ticker = asyncio.get_running_loop().create_task(
            self._tick_loop(), name="store-ticker"
        )
        self._observer = asyncio.get_running_loop().create_task(
            self._observe_loop(), name="store-liveness-clock"
        )
        if cfg.metrics_port:
            from .metrics import MasterMetrics, available

            if available():
                self.status_cache = self.status()
                self.metrics = MasterMetrics(self)
                self.metrics.serve(cfg.metrics_port)
            else:
                log.warning("store master: prometheus_client is not installed; metrics are off")
        log.info(
            "store master %d serving %s (raft %s, %s)",
            cfg.node_id,
            self.address,
            peers[cfg.node_id],
            cfg.durability,
        )

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self._watch.stop()
        for t in (self._ticker, self._observer):
            if t is not None:
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t
        if self._snap_task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._snap_task, 30.0)
        for t in list(self._conns):
            t.cancel()
        for t in list(self._conns):
            with contextlib.suppress(BaseException):
                await t
        if self.node is not None:
            if _durable(self.cfg) and self.cfg.snapshot_on_stop:
                try:
                    await asyncio.wait_for(self.node.snapshot_now(), 30.0)
                except Exception as e:  # noqa: BLE001 - the log still has everything
                    log.warning("store master: snapshot at stop failed: %r", e)
            await self.node.stop()

    # ---------------------------------------------------------------- leader soft state

    def _on_leader_change(self, ch: Any) -> None:
        if not ch.is_self:
            return
        now = time.monotonic()
        # The previous leaders' leases are unknown here: every object one of them may have
        # leased counts as leased for one lease period (TermStart says which: not those
        # created or completed in this term); nodes get a full heartbeat TTL from now. (A
        # lone replica holding no object can have no earlier leases: it skips the period.)
        alone = len(self.cfg.peers) <= 1 and self.sm.object_count() == 0
        node, sm = self.node, self.sm
        assert node is not None  # the callback is the node's
        ts = TermStart(node.status()["last_index"] + 1)
        self._machine.term_start = ts

        def fresh(key: str) -> bool:
            ts.observe(node.applied_index + 1, sm.processing)  # every earlier entry applied?
            return ts.fresh(key, sm.version_of(key))

        self.term_start = ts
        self.leases = LeaseTable(
            start=now, grace=0.0 if alone else self.cfg.lease_ttl_s, fresh=fresh
        )
        self.liveness = _judge(self.cfg, now)
        self.liveness.reset(self.sm.nodes(), now)
        self.stats = AccessStats()
        self.stats.reset(self.sm.keys())
        # Holds noted by an earlier leadership are judged by the blanket period instead.
        self.holds = HoldTracker(self.cfg.lease_ttl_s)
        self.put_ages = PutAges()  # every put in flight gets a full timeout from now
        self._plans.clear()
        self._owners.clear()
        self._node_owners.clear()
        self._writers.clear()
        self._writer_times.clear()

    def _on_hold(self, index: int, release_at: float, proposer: str) -> None:
        # Called inside apply (before the proposer's future resolves, so the ticker can never
        # see the tag unnoted). Only this process's own proposals carry a time on its clock.
        if proposer == self.server_id:
            self.holds.note(index, release_at)

    async def _tick_loop(self) -> None:
        cfg = self.cfg
        last_reclaim = 0.0
        while True:
            await asyncio.sleep(cfg.ticker_s)
            if self.metrics is not None:
                with contextlib.suppress(Exception):
                    self.status_cache = self.status()
            node = self.node
            if node is None:
                continue
            self._snapshot_by_keys(node)
            if not node.is_leader:
                continue
            try:
                mono = time.monotonic()
                await self._expire_nodes(mono)
                if mono - last_reclaim >= min(cfg.put_timeout_s / 4, 2.0):
                    last_reclaim = mono
                    # Stale puts are judged on this leader's monotonic clock (PutAges) and
                    # freed by version; Reclaim only finishes drains (its put cutoff is
                    # never reached): a wall clock that jumps or runs ahead on a new leader
                    # must not free memory a live writer is still writing.
                    stale = self.put_ages.stale(
                        self.sm.processing_puts(), mono, cfg.put_timeout_s, cfg.max_batch_keys
                    )
                    if stale:
                        await self._propose_plain(
                            C.PutRevoke([k for k, _ in stale], [v for _, v in stale])
                        )
                    if any(s.state != "mounted" for s in self.sm.segments()):
                        await self._propose_plain(C.Reclaim(now=_now(), put_timeout=_NEVER))
                await self._release_held(mono)
                await self._evict(mono)
                self.leases.purge(mono)
            except (TimeoutError, ReplogError) as e:
                log.debug("store ticker: %s", e)
            except Exception:
                log.exception("store ticker failed")

    async def _observe_loop(self) -> None:
        """The liveness judge's own sense of time: an observation every ticker turn, apart
        from the ticker (whose turns wait for proposals), so a gap between two of them means
        this process did not run -- and could not hear heartbeats -- for that long."""
        period = min(self.cfg.ticker_s, self.liveness.max_gap / 4)
        while True:
            await asyncio.sleep(period)
            t0 = time.monotonic()
            if self.liveness.observe(t0) and self.node is not None and self.node.is_leader:
                log.warning(
                    "store master: this leader did not run for over %.1f s (a stall); node"
                    " silence during it is not counted against the nodes",
                    self.liveness.max_gap,
                )

    async def _expire_nodes(self, mono: float) -> None:
        """One liveness judgement (master/liveness.py) and the expiry it decides."""
        v = self.liveness.tick(mono, node_capacity(self.sm.segments()))
        if v.suspect and v.suspect != self._suspects:
            log.info("store master: storage nodes %s are suspect (no heartbeat)", v.suspect)
        self._suspects = v.suspect
        if v.expire:
            log.warning("store master: storage nodes %s missed heartbeats; expiring them", v.expire)
            await self._propose_plain(C.ExpireNodes(node_ids=v.expire, now=_now()))
            self.liveness.expired(v.expire)
            self._last_expiry = self.liveness.heard
            self.counters["nodes_expired"] = self.counters.get("nodes_expired", 0) + len(v.expire)

    def _snapshot_by_keys(self, node: RaftNode) -> None:
        """Start a snapshot (in the background) once ``snapshot_keys`` keys were applied
        since the last one this replica started: on every replica, leader or not."""
        done = self.sm.applied_keys
        if not _durable(self.cfg) or done - self._keys_at_snapshot < self.cfg.snapshot_keys:
            return
        if self._snap_task is not None and not self._snap_task.done():
            return
        self._keys_at_snapshot = done

        async def snap() -> None:
            try:
                await node.snapshot_now()
            except Exception as e:  # noqa: BLE001 - the log still has everything
                log.warning("store master: snapshot by keys failed: %r", e)

        self._snap_task = asyncio.get_running_loop().create_task(snap(), name="store-snapshot")

    async def _release_held(self, mono: float) -> None:
        """Release the bytes of forced removes once every lease on them is over
        (:class:`~kvmesh.store.master.policy.HoldTracker` decides)."""
        tags = self.sm.held_tags()
        if not tags:
            return
        rel = self.holds.due(tags, self.leases, mono)
        if rel is not None:
            await self._propose_plain(rel)
            self.holds.forget(rel.tags)

    def _object_excess(self) -> int:
        """Objects to evict for the object cap: none below its high watermark, else down
        to ``high_watermark - evict_ratio`` of it (as for bytes)."""
        cap = self.cfg.max_objects
        n = self.sm.object_count()
        if not cap or n < self.cfg.high_watermark * cap:
            return 0
        return max(1, n - int((self.cfg.high_watermark - self.cfg.evict_ratio) * cap))

    async def _evict(self, mono: float, need: int = 0, objects: int = 0) -> int:
        """Propose one Evict if usage is above the watermark (or ``need`` bytes are wanted).
        Leases are judged on the monotonic clock; soft pins then look live (their expiry is
        wall time), which only makes the choice more conservative -- ``apply`` re-checks
        pins against the command's wall-clock ``now``."""
        cfg = self.cfg
        plan = choose_victims(
            self.sm,
            self.leases,
            self.stats,
            mono,
            cfg.high_watermark,
            cfg.evict_ratio,
            need=need,
            objects=max(objects, self._object_excess()),
        )
        if not plan.keys:
            return 0
        self.leases.block(plan.keys)
        try:
            res = await self._propose_plain(
                C.Evict(
                    keys=plan.keys, versions=plan.versions, now=_now(), allow_soft=plan.allow_soft
                )
            )
        finally:
            self.leases.unblock(plan.keys)
        gone = [k for k, c in zip(plan.keys, res.codes) if c == 0]
        self.stats.forget(gone)
        self.counters["evicted"] = self.counters.get("evicted", 0) + len(gone)
        return int(res.freed)

    async def _propose_plain(self, cmd: Any) -> Any:
        assert self.node is not None
        data = _echo_enc.encode(_Echoed(C.encode_command(cmd)))
        return (await self.node.propose(data)).result

    # ------------------------------------------------------------------------- server

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: Slot
    ) -> None:
        # ``token``: the listener's admission (per-source caps, eviction, minimum age)
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        inflight: set[asyncio.Task] = set()
        slots = asyncio.Semaphore(self.cfg.max_inflight)
        watched: Watched | None = None
        try:
            try:
                hs = ServerHandshake(self.sec, P.SERVICE, self.server_id)
                who = await arun_server(reader, writer, hs, self.cfg.handshake_timeout_s)
                # Sessions and storage nodes bind to the authenticated role and id: a
                # client's connection is never the same peer as node X's (_admit).
                peer = f"{hs.peer_role}:{who}"
            except TRANSPORT_ERRORS as e:
                self._throttle.log(
                    logging.INFO,
                    "auth",
                    "store master: handshake from %s refused: %s",
                    writer.get_extra_info("peername"),
                    str(e)[:200],
                )
                return
            if not self._limiter.authenticated(token):
                return  # evicted to make room while it was still unauthenticated
            out = _Replies(writer, self.cfg.request_timeout_s)
            # Idle and begun-frame deadlines: the listener's one sweeper (replog's
            # DeadlineWatch), not a timeout context per request (two cost ~15 us of a
            # single-key lookup under uvloop).
            watched = self._watch.watch(writer, _framing.FrameDecoder(self.cfg.max_frame))
            turn = 0  # requests taken since this connection last let the loop run others
            while True:
                # Read no further request while the peer leaves our replies unread.
                await out.wait_writable()
                try:
                    bodies = await read_frames(reader, watched)
                except TimeoutError:  # idle, or a begun frame that did not end in time
                    return
                for i, body in enumerate(bodies):
                    if i:
                        await out.wait_writable()
                    turn += 1
                    if turn >= TURN_REQUESTS:
                        # One read holds up to 256 KiB of frames (thousands of single-key
                        # gets answered inline without a suspension): let the other
                        # connections in every few requests, or one pipelining peer holds
                        # the loop for all of them (~0.5 s per read here).
                        turn = 0
                        await asyncio.sleep(0)
                    try:
                        req = P.decode_request(body)
                    except (msgspec.DecodeError, msgspec.ValidationError) as e:
                        # Answered, not dropped: the frame ended where its length said, so
                        # the connection is still in step, and a dropped connection reads
                        # to the sender as an outage to retry until its deadline.
                        log.info("store master: undecodable request: %s", str(e)[:200])
                        await out.send(_framing.encode_frame(P.encode(P.undecodable(body, e))))
                        continue
                    if type(req) is P.HeartbeatReq and out.ready():
                        # Heartbeats never wait for a task, a slot or the requests queued
                        # before them: liveness must not depend on the request load.
                        self._reply_inline(req, out, peer)
                        continue
                    if type(req) in _LEASE_READS and self._reply_now(req, out, peer):
                        continue  # answered inline from the leader lease
                    if slots.locked():
                        # Our own in-flight limit stops the reading, not the peer: a frame it
                        # began meanwhile must not run out of time (a quorum loss holds
                        # every slot for long).
                        watched.pause()
                        try:
                            await slots.acquire()
                        finally:
                            watched.resume()
                    else:
                        await slots.acquire()
                    t = asyncio.get_running_loop().create_task(self._handle(req, out, peer))
                    inflight.add(t)
                    t.add_done_callback(inflight.discard)
                    t.add_done_callback(lambda _t: slots.release())
        except TRANSPORT_ERRORS as e:  # incl. uvloop's RuntimeError on a reset connection
            log.debug("store master: connection ended: %s: %s", type(e).__name__, str(e)[:200])
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug must cost one connection, never the server
            log.exception("store master: connection failed")
        finally:
            if watched is not None:
                self._watch.unwatch(watched)
            for t in inflight:
                t.cancel()
            self._limiter.release(token)
            self._conns.discard(task)
            writer.close()

    def _reply_now(self, req: Any, out: _Replies, peer: str) -> bool:
        """Answer a read request inline, without a task, when the leader's lease makes its
        read index immediate (the common case): the same checks and replies as
        :meth:`_dispatch` minus the scheduling. False: handle it as any request (a big
        batch, no lease now, or a reply being sent or left unread: backpressure of
        :class:`_Replies` applies)."""
        node = self.node
        if node is None or P.request_key_count(req) > _INLINE_KEYS or not out.ready():
            return False
        try:
            if node.lease_read_index() is None:
                return False
        except ReplogError:  # stopped: the task path answers with the right error
            return False
        self._reply_inline(req, out, peer)
        return True

    def _reply_inline(self, req: Any, out: _Replies, peer: str) -> None:
        """Answer a request that needs no suspension (a lease read, a heartbeat) at once."""
        started = time.perf_counter()
        try:
            node = self._admit(req, peer)
            if type(req) is P.HeartbeatReq:
                resp: Any = self._heartbeat(node, req)
            else:
                resp = self._read_now(req)
        except Exception as e:  # noqa: BLE001 - mapped to a reply as in _handle
            resp = self._error_reply(req, e)
        self._observe(req, resp, started)
        out.send_now(_framing.encode_frame(P.encode(resp)))

    async def _handle(self, req: Any, out: _Replies, peer: str = "") -> None:
        # A GetReplicas reply is the one large reply (up to max_reply_bytes): one at a time
        # per connection, from the lookup until it is handed to the socket, so a peer that
        # pipelines them makes us hold one, not max_inflight of them.
        # Likewise a connection's remove-by-prefix rounds run one at a time: it holds one
        # place in the master's scan queue (MAX_SCANS), however many it pipelines.
        t = type(req)
        big = (
            out.big
            if t is P.GetReplicasReq
            else out.scan
            if t is P.RemovePrefixReq
            else contextlib.nullcontext()
        )
        async with big:
            await self._handle_one(req, out, peer)

    async def _handle_one(self, req: Any, out: _Replies, peer: str) -> None:
        started = time.perf_counter()
        try:
            resp = await self._dispatch(req, peer)
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the server
            resp = self._error_reply(req, e)
        self._observe(req, resp, started)
        await out.send(_framing.encode_frame(P.encode(resp)))

    def _error_reply(self, req: Any, exc: Exception) -> Any:
        """The reply for a request whose handling raised ``exc``."""
        try:
            raise exc
        except NotLeaderError as e:
            return P.Redirect(req.rid, e.leader_id or 0, e.leader_addr or "")
        except _Busy as e:
            return P.ErrorResp(req.rid, e.code, str(e), retry=True)
        except (TimeoutError, ProposalTimeout, ReadTimeout) as e:
            return P.ErrorResp(
                req.rid, E.StoreTimeout.code, f"timeout (outcome unknown): {e}", retry=True
            )
        except SessionExpiredError as e:
            return P.ErrorResp(req.rid, E.StoreUnavailable.code, f"session: {e}", retry=False)
        except CommandError as e:
            return P.ErrorResp(req.rid, E.InternalError.code, f"command failed: {e}", retry=False)
        except NodeStopped as e:
            return P.ErrorResp(req.rid, E.StoreUnavailable.code, f"stopped: {e}", retry=True)
        except ProposalTooLarge as e:  # deterministic: the same request can never fit
            return P.ErrorResp(
                req.rid,
                E.InvalidParams.code,
                f"request too large for one log entry, split the batch: {e}"[:500],
                retry=False,
            )
        except ReplogError as e:  # ProposalDropped/ProposalLost: not applied, retry
            return P.ErrorResp(
                req.rid, E.StoreUnavailable.code, f"{type(e).__name__}: {e}", retry=True
            )
        except E.StoreError as e:
            return P.ErrorResp(req.rid, e.code, str(e)[:500], retry=False)
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the server
            log.warning("store master: request %s failed: %r", type(req).__name__, e)
            return P.ErrorResp(req.rid, E.InternalError.code, f"{type(e).__name__}: {e}"[:500])

    def _observe(self, req: Any, resp: Any, started: float) -> None:
        if self.metrics is not None:
            rt = type(resp)
            outcome = "redirect" if rt is P.Redirect else "error" if rt is P.ErrorResp else "ok"
            self.metrics.observe(type(req).__name__, outcome, P.request_key_count(req), started)

    def _leader(self) -> RaftNode:
        node = self.node
        if node is None:
            raise NodeStopped("not started")
        if not node.is_leader:
            lid = node.leader_id
            raise NotLeaderError(lid, node.address_of(lid))
        return node

    def _check(self, req: Any) -> None:
        # Conforming clients validate before sending; a request with a bad field comes from
        # a broken or hostile peer and is refused whole, before any work.
        t = type(req)
        fields = _checked_fields(t)
        parts = t is P.ExistsPartsReq
        if parts:
            # Checked by parts (types.bad_parts), never expanded before the count is known.
            # The suffixes count on their own too: with no keys the product is 0, yet
            # bad_parts would still check every suffix (Python work per part of the frame).
            n = max(P.request_key_count(req), len(req.suffixes))
            keys: list[Any] = []
        else:
            keys = req.keys if "keys" in fields else []
            n = len(keys)
        if n > self.cfg.max_batch_keys:
            raise E.InvalidParams(
                f"{n} keys in one request; the limit is {self.cfg.max_batch_keys}"
            )
        why = bad_parts(req.prefix, req.keys, req.suffixes) if parts else None
        if keys:
            why = bad_key(keys)
        if why is not None:
            raise E.InvalidKey(why)
        for name in fields.counted:  # sizes, versions: one per key
            vals = getattr(req, name)
            if vals and len(vals) != len(keys):
                raise E.InvalidParams(f"{len(vals)} {name} for {len(keys)} keys")
        sizes = req.sizes if "sizes" in fields else None
        if sizes is not None and (
            # list[int] as decoded (msgspec): C-level min/max instead of a test per key
            len(sizes) != len(keys)
            or (sizes and not 0 < min(sizes) <= max(sizes) <= MAX_OBJECT_SIZE)
        ):
            raise E.InvalidParams(f"sizes must be 1..{MAX_OBJECT_SIZE}, one per key")
        config = req.config if "config" in fields else None
        if config is not None and not 1 <= config.replica_num <= MAX_REPLICAS:
            raise E.InvalidParams(f"replica_num must be 1..{MAX_REPLICAS}")
        for name in fields.names:  # node_id, segment, endpoint, host_id
            v = getattr(req, name)
            if v is not None and not 0 < len(v) <= _MAX_NAME:
                raise E.InvalidParams(f"{name} must be 1..{_MAX_NAME} characters")
        if "host" in fields and len(req.host) > _MAX_NAME:  # GetReplicas: "" means none
            raise E.InvalidParams(f"host must be at most {_MAX_NAME} characters")

    def _admit(self, req: Any, peer: str) -> RaftNode:
        """Checks every request passes before any work: counted, well-formed, this replica
        leads, and a session is used only by the peer that owns it."""
        name = type(req).__name__
        self.counters[name] = self.counters.get(name, 0) + 1
        self._check(req)
        node = self._leader()
        fields = _checked_fields(type(req))
        sess = req.session if "session" in fields else None
        if sess is not None:
            # A session belongs to the authenticated peer that used it first on this leader
            # (after a failover: first use again). Another peer naming it -- a confused or
            # buggy client -- could otherwise get someone else's cached results or move
            # their acknowledgement floor.
            owner = self._owners.get(sess.client_id)
            if owner is None:
                owner = self._owners[sess.client_id] = peer
                if len(self._owners) > _MAX_OWNERS:
                    self._owners.popitem(last=False)
            if owner != peer:
                raise E.InvalidParams(f"session {sess.client_id} belongs to another client")
        node_id = req.node_id if "node_id" in fields else None
        if node_id is not None:
            # Mount, Unmount, Heartbeat: only storage node X (its credential) acts for node
            # X (and the sub-nodes X/... its process hosts), or a replica-role peer (an
            # operator: it holds the cluster secret, which derives node X's key anyway); a
            # client credential never can.
            role, _, who = peer.partition(":")
            if not (role == "replica" or (role == "node" and speaks_for_node(who, node_id))):
                raise E.InvalidParams(
                    f"only storage node {node_id[:_MAX_NAME]!r} may {name[:-3].lower()} it "
                    f"(this connection is {peer[:_MAX_NAME]!r})"
                )
            self._check_node_owner(node_id, peer)
        return node

    def _read_now(self, req: Any) -> Any:
        """A read request once the read index is applied here (no log entry)."""
        t = type(req)
        if t is P.GetReplicasReq:
            return self._get_replicas(req)
        if t is P.ExistsReq:
            return P.CodesResp(req.rid, self.sm.exists_flags(req.keys))  # keys: _check
        if t is P.ExistsPartsReq:
            if req.leading:
                return P.CountResp(
                    req.rid, self.sm.exists_leading(req.prefix, req.keys, req.suffixes)
                )
            return P.CodesResp(req.rid, self.sm.exists_codes(req.prefix, req.keys, req.suffixes))
        sizes = self.sm.get_size(req.keys)
        return P.SizesResp(req.rid, [min(0, s) for s in sizes], [max(s, 0) for s in sizes])

    async def _dispatch(self, req: Any, peer: str = "") -> Any:
        t = type(req)
        if t is P.StatusReq:
            self.counters[t.__name__] = self.counters.get(t.__name__, 0) + 1
            return P.StatusResp(req.rid, self.status())
        node = self._admit(req, peer)
        if t in _LEASE_READS:
            await node.read_index()
            self._leader()
            return self._read_now(req)
        if t is P.HeartbeatReq:
            return self._heartbeat(node, req)
        if t is P.RegisterReq:
            cid = await node.register_session()
            self._owners[cid] = peer
            return P.RegisterResp(req.rid, cid)
        if t is P.PutStartReq:
            return await self._put_start(node, req)
        if t is P.RemoveReq:
            return await self._remove(node, req)
        if t is P.RemoveAllReq:
            return await self._remove_all(node, req)
        if t is P.RemovePrefixReq:
            return await self._remove_prefix(node, req)
        if t is P.PutEndReq or t is P.PutRevokeReq:
            return await self._finish_put(node, req, t is P.PutEndReq)
        if t is P.MountReq:
            if req.size <= 0:
                raise E.InvalidParams("segment size must be positive")
            # A cheap early refusal; the cap itself is judged in apply (in log order), as
            # mounts in flight together all pass this check.
            if self.sm.usage().segments >= self.cfg.max_segments:
                raise E.NoSpace(
                    f"the pool holds {self.cfg.max_segments} segments, its limit (max_segments)"
                )
            cmd = C.Mount(
                node_id=req.node_id,
                segment=req.segment,
                endpoint=req.endpoint,
                host_id=req.host_id,
                size=req.size,
                now=_now(),
                max_segments=self.cfg.max_segments,
            )
            code = _code_of(await self._propose(node, req.session, cmd))
            if code == 0:
                self.liveness.beat(req.node_id, time.monotonic())
                self._node_owners[req.node_id] = peer
                self._node_owners.move_to_end(req.node_id)
                while len(self._node_owners) > _MAX_OWNERS:
                    self._node_owners.popitem(last=False)
            return P.CodesResp(req.rid, [code])
        if t is P.UnmountReq:
            if not 0.0 <= req.grace <= 3600.0:
                raise E.InvalidParams("grace must be within 0..3600 s")
            cmd = C.Unmount(node_id=req.node_id, segment=req.segment, now=_now(), grace=req.grace)
            return P.CodesResp(req.rid, [_code_of(await self._propose(node, req.session, cmd))])
        raise E.InvalidParams(f"unsupported request {t.__name__}")

    def _heartbeat(self, node: RaftNode, req: P.HeartbeatReq) -> P.CodesResp:
        known = req.node_id in self.sm.nodes()
        if known:
            self.liveness.beat(req.node_id, time.monotonic())
        return P.CodesResp(req.rid, [0 if known else E.NodeNotFound.code])

    async def _propose(self, node: RaftNode, sess: P.Session, cmd: Any) -> Any:
        return (await self._propose_echo(node, sess, _Echoed(C.encode_command(cmd)))).result

    async def _propose_echo(self, node: RaftNode, sess: P.Session, env: _Echoed) -> Any:
        res = await node.propose(_echo_enc.encode(env), sess.client_id, sess.seq, sess.ack)
        if isinstance(res, SessionRejected):
            raise SessionExpiredError(f"session {res.client_id} seq {res.seq}: {res.reason}")
        return res

    def _planned(self, sess: P.Session, make: Any) -> tuple[list[int], float]:
        """The per-key answers (and hold release time) planned for this request: computed by
        ``make()`` the first time, reused for a retry of the same ``(client, seq)``."""
        k = (sess.client_id, sess.seq)
        plan = self._plans.get(k)
        if plan is None:
            plan = self._plans[k] = make()
            while len(self._plans) > 4096:
                self._plans.popitem(last=False)
        return plan

    @staticmethod
    def _merge(planned: list[int], applied: list[int]) -> list[int]:
        """Per key: the planned refusal, or the applied entry's code (in order)."""
        if len(planned) == len(applied) and not any(planned):
            return list(applied)  # nothing refused before the log
        it = iter(applied)
        out = [c if c else next(it, int(E.InternalError.code)) for c in planned]
        return out

    def _check_node_owner(self, node_id: str, peer: str) -> None:
        """A storage node id with mounted segments belongs to the authenticated peer that
        mounted them (on this leader; after a failover, to the first peer naming it, like a
        session). Node ids and segment names are in every replica descriptor, so without
        this any peer could unmount another node's segment (dropping its objects), keep a
        dead node alive with heartbeats, or mount under another node's id. A node id with no
        segment left (expired, unmounted) is free again: a restarted node may reuse it."""
        owners = self._node_owners
        if node_id not in self.sm.nodes():
            return  # nothing to protect; a successful Mount binds it
        owner = owners.get(node_id)
        if owner is None:
            owners[node_id] = peer
            while len(owners) > _MAX_OWNERS:
                owners.popitem(last=False)
        elif owner != peer:
            raise E.InvalidParams(f"storage node {node_id[:_MAX_NAME]!r} belongs to another peer")

    def _get_replicas(self, req: P.GetReplicasReq) -> P.ReplicasResp | P.ReplicaTableResp:
        mono = time.monotonic()  # before the lookup: the lease is never longer than promised
        ttl = self.cfg.lease_ttl_s
        keys = req.keys
        t = self.sm.lookup_table(keys, req.host or None, self.cfg.max_reply_bytes)
        codes = t.codes
        every = codes.count(0) == len(codes)  # all found (the usual batch): no index lists
        ok: Any = range(len(keys)) if every else [i for i, c in enumerate(codes) if c == 0]
        if self._removing_all:
            until = [0.0] * len(ok)
        else:
            until = self.leases.grant(keys if every else [keys[i] for i in ok], mono, ttl)
        if 0.0 in until:
            # A removal of these keys is in flight: no lease on memory about to be freed,
            # and no descriptor of it in the reply.
            codes = list(codes)
            for i, u in zip(ok, until):
                if u == 0.0:
                    codes[i] = E.ObjectNotFound.code
            granted = [keys[i] for i in ok if codes[i] == 0]
            keep = t.rows[np.asarray(codes, np.int64)[t.rows[:, 0]] == 0]
            t = t._replace(codes=codes, rows=keep)
        else:
            granted = keys if every else [keys[i] for i in ok]
        self.stats.touch(granted)
        self.hits += len(granted)
        self.misses += len(keys) - len(granted)
        sizes = t.sizes  # 0 for every key not found (lookup_table), blocked ones aside
        if len(granted) < len(ok):
            sizes = [z if c == 0 else 0 for c, z in zip(codes, sizes)]
        if req.table:
            rows = t.rows.astype("<i8", copy=False).tobytes()
            return P.ReplicaTableResp(req.rid, codes, sizes, t.segments, rows, int(ttl * 1000))
        return P.ReplicasResp(req.rid, codes, sizes, replica_lists(t), int(ttl * 1000))

    async def _put_start(self, node: RaftNode, req: P.PutStartReq) -> P.PutStartResp:
        keys = req.keys
        n = len(keys)
        now = _now()
        if req.upsert:
            # The core's rule: an existing, leased key answers ObjectHasLease (an upsert would
            # rewrite or free memory a reader is copying).
            full = C.Upsert(keys=keys, sizes=req.sizes, config=req.config, now=now)

            def make() -> tuple[list[int], float]:
                exists = [self.sm.state_of(k) != State.GONE for k in keys]
                return plan_upsert(self.leases, exists, full, time.monotonic()).codes, 0.0

            planned, _ = self._planned(req.session, make)
        else:
            planned = [0] * n
        if any(planned):
            todo = [i for i in range(n) if not planned[i]]
            tk = [keys[i] for i in todo]
            ts = [req.sizes[i] for i in todo]
        else:
            tk, ts = keys, req.sizes
        # Make room first when the pool is short: a put reports NoSpace only when nothing is
        # evictable (the put itself stays one entry under the client's session). Only for
        # copies that could fit once room is made: a key larger than the whole pool, or more
        # copies than there are storage nodes, would evict everything and still not fit.
        copies = req.config.replica_num
        usage = self.sm.usage()
        if ts and max(ts) * copies <= usage.capacity:
            need = sum(ts) * copies
        else:
            need = sum(z * copies for z in ts if z * copies <= usage.capacity)
        free = usage.capacity - usage.used
        if need > free and copies <= len(self.sm.nodes()):
            await self._evict(time.monotonic(), need=min(need, usage.capacity) - free)
        if self.cfg.max_objects and not req.upsert:
            tk, ts, planned = await self._object_cap(req, tk, ts, planned)
        cls = C.Upsert if req.upsert else C.PutStart
        cmd = cls(keys=tk, sizes=ts, config=req.config, now=now)
        if req.upsert:
            self.leases.block(tk)
        pending = len(tk) if self.cfg.max_objects else 0  # counted by the object cap
        self._objects_pending += pending
        try:
            res = await self._propose_echo(
                node, req.session, _Echoed(C.encode_command(cmd), planned)
            )
        finally:
            self._objects_pending -= pending
            if req.upsert:
                self.leases.unblock(tk)
        planned, r = res.codes or [0] * n, res.result
        if len(planned) != n:
            raise E.InvalidParams("a retried put named different keys than the first attempt")
        run = None
        if not any(planned) and len(r.codes) == n:  # nothing decided before the log
            codes, versions = list(r.codes), r.versions
            if type(r) is C.PutStartRun:
                replicas, run = [], r.run  # sent as it is cached: compact
            else:
                replicas = r.replicas
        else:
            codes = list(planned)
            replicas = [None] * n
            versions = [0] * n
            j = 0
            rr, rv = r.replicas, r.versions  # (properties of a PutStartRun: built once)
            for i in range(n):
                if planned[i]:
                    continue
                codes[i], replicas[i], versions[i] = r.codes[j], rr[j], rv[j]
                j += 1
        if 0 in codes:  # every key placed has the entry's index as version
            self._bind_writer(versions[codes.index(0)], req.session.client_id)
        return P.PutStartResp(
            req.rid, codes, replicas, versions, int(self.cfg.put_timeout_s * 1000), run
        )

    async def _object_cap(
        self, req: P.PutStartReq, tk: list[str], ts: list[int], planned: list[int]
    ) -> tuple[list[str], list[int], list[int]]:
        """The object-count cap (``max_objects``): new keys beyond it answer NoSpace per
        key (decided once per request, so a retry gets the same answer), after an eviction
        of as many objects as the put lacks. Judged on this leader before proposing, the
        keys of its puts still in the log counted too; upserts replace, never add."""
        cap = self.cfg.max_objects
        room = cap - self.sm.object_count() - self._objects_pending
        if len(tk) <= room:
            return tk, ts, planned
        new = [i for i, k in enumerate(tk) if self.sm.state_of(k) == State.GONE]
        if len(new) > room:
            await self._evict(time.monotonic(), objects=len(new) - max(room, 0))
            room = cap - self.sm.object_count() - self._objects_pending
        if len(new) <= room:
            return tk, ts, planned

        def make() -> tuple[list[int], float]:
            over = set(new[max(room, 0) :])  # positions in tk: the keys not refused yet
            codes, j = list(planned), 0
            for i, c in enumerate(planned):
                if not c:
                    if j in over:
                        codes[i] = int(E.NoSpace.code)
                    j += 1
            return codes, 0.0

        planned, _ = self._planned(req.session, make)
        keep = [i for i, c in enumerate(planned) if not c]
        keys, sizes = req.keys, req.sizes
        return [keys[i] for i in keep], [sizes[i] for i in keep], planned

    def _bind_writer(self, version: int, client_id: int) -> None:
        """Remember that ``client_id`` started the put of entry ``version`` (and forget the
        bindings older than two put timeouts: those puts are reclaimed by now)."""
        w, times = self._writers, self._writer_times
        mono = time.monotonic()
        w[version] = client_id
        times.append((mono, version))
        old = mono - 2 * self.cfg.put_timeout_s - self.cfg.ticker_s
        while times and (times[0][0] < old or len(times) > _MAX_WRITERS):
            w.pop(times.popleft()[1], None)

    async def _finish_put(self, node: RaftNode, req: Any, end: bool) -> P.CodesResp:
        """PutEnd / PutRevoke. A put's version is its log index (easy to guess), so the
        leader also remembers which session started each put it answered and refuses
        (InvalidWrite) another session's PutEnd/PutRevoke of it: otherwise any peer could
        publish a writer's half-written bytes or free them under it. Puts started under an
        earlier leader are judged by version only."""
        keys, vers = req.keys, req.versions
        me = req.session.client_id

        def make() -> tuple[list[int], float]:
            n = len(keys)
            if len(vers) != n:  # apply answers InvalidParams per key
                return [0] * n, 0.0
            w = self._writers
            # per distinct version (a batch names one or a few), not per key
            foreign = {v for v in set(vers) if w.get(v, me) != me}
            if not foreign:
                return [0] * n, 0.0
            bad = int(E.InvalidWrite.code)
            return [bad if v in foreign else 0 for v in vers], 0.0

        planned, _ = self._planned(req.session, make)
        if any(planned):
            todo = [i for i, c in enumerate(planned) if not c]
            tk = [keys[i] for i in todo]
            tv = [vers[i] for i in todo] if len(vers) == len(keys) else list(vers)
        else:
            tk, tv = keys, vers
        cmd = C.PutEnd(keys=tk, versions=tv) if end else C.PutRevoke(keys=tk, versions=tv)
        res = await self._propose_echo(node, req.session, _Echoed(C.encode_command(cmd), planned))
        out = self._merge(res.codes or [0] * len(keys), res.result.codes)
        if len(out) != len(keys):
            raise E.InvalidParams("a retried put_end named different keys than the first attempt")
        if end:
            self.stats.touch(keys if not any(out) else [k for k, c in zip(keys, out) if c == 0])
        return P.CodesResp(req.rid, out)

    async def _remove(self, node: RaftNode, req: P.RemoveReq) -> P.CodesResp:
        """The core's rule (``plan_remove``): leased keys answer ObjectHasLease, or with
        ``force`` are removed with their bytes held until the leases are over."""
        keys = req.keys
        plan = None

        def make() -> tuple[list[int], float]:
            nonlocal plan
            plan = plan_remove(self.leases, keys, time.monotonic(), req.force)
            return plan.codes, plan.release_at

        planned, release_at = self._planned(req.session, make)
        todo = [k for k, c in zip(keys, planned) if not c]
        if plan is None:  # a retry: rebuild the command from the first attempt's decisions
            plan_cmd = C.Remove(todo, force=req.force, hold=release_at > 0.0)
        else:
            plan_cmd = plan.command or C.Remove([], force=req.force)
        self.leases.block(todo)
        try:
            env = _Echoed(C.encode_command(plan_cmd), planned, release_at, self.server_id)
            res = await self._propose_echo(node, req.session, env)
        finally:
            self.leases.unblock(todo)
        out = self._merge(res.codes or [0] * len(keys), list(res.result.codes))
        if len(out) != len(keys):
            raise E.InvalidParams("a retried remove named different keys than the first attempt")
        self.stats.forget(k for k, c in zip(keys, out) if c == 0)
        return P.CodesResp(req.rid, out)

    async def _remove_all(self, node: RaftNode, req: P.RemoveAllReq) -> P.CountResp:
        mono = time.monotonic()
        self._removing_all += 1  # no new leases anywhere while it is in flight
        try:
            release_at = 0.0
            if mono < self.leases.blanket_until:
                if not self.term_start.settled:
                    # An earlier term's entry still to apply may create a key this list
                    # would miss (and RemoveAll then remove it under an old lease).
                    raise _Busy("a new leader is still applying the earlier terms' entries")
                leased = self.leases.leased_keys(self.sm.keys(), mono)
            else:
                leased = self.leases.all_leased(mono)
            if req.force:
                release_at = max((self.leases.expiry(k) for k in leased), default=0.0)
                cmd = C.RemoveAll(force=True, hold=release_at > 0.0)
            else:
                cmd = C.RemoveAll(skip=leased)
            env = _Echoed(C.encode_command(cmd), [], release_at, self.server_id)
            res = (await self._propose_echo(node, req.session, env)).result
        finally:
            self._removing_all -= 1
        return P.CountResp(req.rid, int(res.removed))

    async def _remove_prefix(self, node: RaftNode, req: P.RemovePrefixReq) -> P.RemovePrefixResp:
        """One round of a remove by prefix: a scan of the table in slices of
        ``_SCAN_SLICE`` keys (yielding between them: a huge table never holds the loop
        long) for at most ``prefix_round_keys`` removable keys, then one entry with the rules
        of :meth:`_remove` (``plan_remove_prefix``). Bounded per request, the client loops
        while ``more``. A retry of the same session seq gets the first round's result from
        the log (the replog session cache), whatever this scan finds."""
        why = key_error(req.prefix)
        if why is not None:
            raise E.InvalidKey(f"prefix: {why}")
        limit = self.cfg.prefix_round_keys
        found: list[str] = []
        skipped = 0
        more = False
        async with self._scan_turn():
            table = self.sm.key_list()
            for lo in range(0, len(table), _SCAN_SLICE):
                if lo:
                    await asyncio.sleep(0)
                mono = time.monotonic()
                leased = None if req.force else (lambda k, m=mono: self.leases.leased(k, m))
                f, n, more = self.sm.prefix_candidates(
                    req.prefix, table[lo : lo + _SCAN_SLICE], limit - len(found), leased
                )
                found += f
                skipped += n
                if more:
                    break
                if sum(map(len, found)) > _ROUND_KEY_BYTES:  # long keys: keep the entry small
                    more = True
                    break
            del table
        cmd, release_at = plan_remove_prefix(
            req.prefix, found, skipped, more, self.leases, time.monotonic(), req.force
        )
        self.leases.block(cmd.keys)
        try:
            env = _Echoed(C.encode_command(cmd), [], release_at, self.server_id)
            res = (await self._propose_echo(node, req.session, env)).result
        finally:
            self.leases.unblock(cmd.keys)
        if type(res) is not C.RemovePrefixResult:
            raise E.InvalidParams("a retried remove_prefix was another request the first time")
        self.stats.forget(k for k in cmd.keys if self.sm.state_of(k) == State.GONE)
        return P.RemovePrefixResp(req.rid, int(res.removed), int(res.skipped), bool(res.more))

    @contextlib.asynccontextmanager
    async def _scan_turn(self) -> AsyncIterator[None]:
        """The scan lock, for at most MAX_SCANS requests queued or scanning at once."""
        if self._scans >= MAX_SCANS:
            raise _Busy(f"busy: {self._scans} remove-by-prefix scans queued; retry")
        self._scans += 1
        try:
            async with self._scan_lock:
                yield
        finally:
            self._scans -= 1

    # ------------------------------------------------------------------------- status

    def status(self) -> dict[str, Any]:
        node = self.node
        st: dict[str, Any] = {"node_id": self.cfg.node_id, "address": self.address}
        if node is not None:
            with contextlib.suppress(ReplogError):
                rs = node.status()
                st.update(
                    {
                        k: rs[k]
                        for k in (
                            "role",
                            "term",
                            "leader",
                            "commit",
                            "applied",
                            "voters",
                            "durability",
                            "sessions",
                            "session_result_bytes",
                        )
                    }
                )
                st["leader_addr"] = node.address_of(node.leader_id) or ""
        st["addrs"] = {
            str(k): v for k, v in (self.cfg.addrs or {self.cfg.node_id: self.address}).items()
        }
        st["segments"] = [msgspec.to_builtins(s) for s in self.sm.segments()]
        st["usage"] = msgspec.to_builtins(self.sm.usage())
        st["objects"] = n_obj = self.sm.object_count()
        st["rss_bytes"] = rss = _rss_bytes()
        st["rss_per_object"] = rss // n_obj if n_obj else 0
        st["max_objects"] = self.cfg.max_objects
        lv = self.liveness
        st["liveness"] = {
            "heard_s": round(lv.heard, 3),
            "stalls": lv.stalls,
            "suspect": list(self._suspects),
            "expired": self.counters.get("nodes_expired", 0),
            "last_expiry_heard_s": round(self._last_expiry, 3),
        }
        st["leases"] = len(self.leases.all_leased(time.monotonic()))
        st["hits"] = self.hits
        st["misses"] = self.misses
        st["requests"] = dict(self.counters)
        return st


def _rss_bytes() -> int:
    """This process's resident set (Linux /proc; elsewhere the peak from getrusage)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _judge(cfg: ServiceConfig, now: float) -> LivenessJudge:
    ttl = cfg.node_ttl_s
    return LivenessJudge(
        ttl,
        cfg.node_suspect_s or ttl / 2,
        cfg.liveness_max_gap_s or default_max_gap(ttl, cfg.ticker_s),
        cfg.expire_max_fraction,
        now,
    )


def _durable(cfg: ServiceConfig) -> bool:
    return cfg.durability == "disk" and cfg.data_dir is not None


_WRITE_HIGH = 1 << 20  # unread reply bytes above which a connection stops and waits


class _Replies:
    """The reply side of one connection: writes one frame at a time and, above
    :data:`_WRITE_HIGH` unread bytes, waits for the peer to read (at most ``timeout`` s,
    then the connection is aborted), so a peer that stops reading holds at most that much
    of our memory plus the reply being written."""

    __slots__ = ("big", "lock", "scan", "timeout", "writer")

    def __init__(self, writer: asyncio.StreamWriter, timeout: float) -> None:
        self.writer = writer
        self.timeout = timeout
        self.lock = asyncio.Lock()
        self.big = asyncio.Lock()
        self.scan = asyncio.Lock()

    async def _drain(self) -> None:
        w = self.writer
        if w.transport.get_write_buffer_size() <= _WRITE_HIGH:
            return
        try:
            await asyncio.wait_for(w.drain(), self.timeout)
        except TimeoutError:
            log.info(
                "store master: a peer left %d reply bytes unread; closing it",
                w.transport.get_write_buffer_size(),
            )
            w.transport.abort()
        except TRANSPORT_ERRORS:
            w.transport.abort()

    async def wait_writable(self) -> None:
        if self.ready():  # the usual case: no lock, no coroutine, the same outcome
            return
        async with self.lock:
            await self._drain()

    async def send(self, frame: bytes) -> None:
        async with self.lock:
            if self.writer.is_closing():
                return
            try:
                self.writer.write(frame)
            except TRANSPORT_ERRORS:
                return
            await self._drain()

    def ready(self) -> bool:
        """Whether a reply may be written at once (:meth:`send_now`): no send in progress
        and the peer keeps up with reading."""
        return (
            not self.lock.locked() and self.writer.transport.get_write_buffer_size() <= _WRITE_HIGH
        )

    def send_now(self, frame: bytes) -> None:
        """Write without waiting, after :meth:`ready`; a backlog this leaves is drained by
        the read loop's next :meth:`wait_writable` before it reads another request."""
        if self.writer.is_closing():
            return
        try:
            self.writer.write(frame)
        except TRANSPORT_ERRORS:
            pass


def _code_of(res: Any) -> int:
    codes = getattr(res, "codes", None)
    if codes is not None:
        return int(codes[0]) if codes else 0
    return int(getattr(res, "code", 0))


def _free_addr(host: str) -> str:
    from ..launcher import free_ports

    return f"{host}:{free_ports(1, host)[0]}"


# --------------------------------------------------------------------------- process


async def run_master(cfg: ServiceConfig, sec: SecurityConfig | None = None) -> int:
    """Run one replica until SIGTERM/SIGINT (exit 0) or a fatal storage error (exit 3)."""
    import signal

    svc = MasterService(cfg, sec)
    await svc.start()
    assert svc.node is not None
    print(f"READY {cfg.node_id} {svc.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = loop.create_task(stop.wait())
    dead = loop.create_task(svc.node.wait_stopped())
    await asyncio.wait([waiter, dead], return_when=asyncio.FIRST_COMPLETED)
    fatal = svc.node.fatal_error
    await svc.stop()
    waiter.cancel()
    return 3 if fatal is not None else 0


def build_arg_parser() -> Any:
    import argparse

    p = argparse.ArgumentParser(
        prog="kvmesh master", description="one replica of the store master group"
    )
    p.add_argument("--id", type=int, default=1)
    p.add_argument("--peers", default="", help="ID=HOST:PORT,... raft addresses of all replicas")
    p.add_argument(
        "--addrs", default="", help="ID=HOST:PORT,... store RPC addresses of all replicas"
    )
    p.add_argument(
        "--listen",
        default=None,
        help="store RPC address (default: this id in --addrs, else 127.0.0.1:7700)",
    )
    p.add_argument("--dir", default=None, help="data directory (needed with --durability disk)")
    p.add_argument("--durability", choices=["disk", "memory"], default="disk")
    p.add_argument("--tick-ms", type=float, default=50.0)
    p.add_argument("--election-ticks", type=int, default=10)
    p.add_argument("--lease-ttl-s", type=float, default=5.0)
    p.add_argument("--put-timeout-s", type=float, default=60.0)
    p.add_argument("--node-ttl-s", type=float, default=10.0)
    p.add_argument(
        "--node-suspect-s",
        type=float,
        default=0.0,
        help="a node silent for the TTL is expired after this much more heard time (0: TTL/2)",
    )
    p.add_argument(
        "--liveness-max-gap-s",
        type=float,
        default=0.0,
        help="a longer gap between the leader's own observations is a stall, not silence"
        " (0: min(TTL/4, 1 s))",
    )
    p.add_argument(
        "--expire-max-fraction",
        type=float,
        default=0.5,
        help="fraction of the nodes and of their bytes one expiry round may drop",
    )
    p.add_argument("--high-watermark", type=float, default=0.90)
    p.add_argument("--evict-ratio", type=float, default=0.05)
    p.add_argument(
        "--max-objects",
        type=int,
        default=0,
        help="objects in the master at most (0: no cap); eviction starts at the high"
        " watermark of it, new keys beyond it answer NoSpace",
    )
    p.add_argument("--handshake-timeout-s", type=float, default=5.0)
    p.add_argument("--idle-timeout-s", type=float, default=600.0)
    p.add_argument("--max-unauthenticated", type=int, default=64)
    p.add_argument(
        "--max-inflight",
        type=int,
        default=ServiceConfig().max_inflight,
        help="requests in flight per connection (reading pauses at the limit)",
    )
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=10.0,
        help="longest proposal or read, and the time a begun request frame has to arrive",
    )
    p.add_argument("--max-segments", type=int, default=1024, help="mounted segments at most")
    p.add_argument(
        "--prefix-round-keys",
        type=int,
        default=8192,
        help="keys one remove-by-prefix round (one log entry) removes at most",
    )
    p.add_argument(
        "--max-sessions",
        type=int,
        default=SessionLimits().max_sessions,
        help="live client sessions at most (the least recently used is ended beyond it)",
    )
    p.add_argument(
        "--max-session-result-bytes",
        type=int,
        default=SessionLimits().max_result_bytes,
        help="cached unacknowledged result bytes per session",
    )
    p.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus metrics on 127.0.0.1:PORT"
    )
    p.add_argument(
        "--snapshot-keys",
        type=int,
        default=500_000,
        help="snapshot after this many keys applied (bounds the log replayed after a crash)",
    )
    p.add_argument("--log-level", default="WARNING")
    return p


def config_from_args(a: Any) -> ServiceConfig:
    return ServiceConfig(
        node_id=a.id,
        peers=parse_peers(a.peers) if a.peers else {},
        addrs=parse_peers(a.addrs) if a.addrs else {},
        listen=a.listen or (None if a.addrs else "127.0.0.1:7700"),
        data_dir=a.dir,
        durability=a.durability,
        tick_s=a.tick_ms / 1000.0,
        election_ticks=a.election_ticks,
        lease_ttl_s=a.lease_ttl_s,
        put_timeout_s=a.put_timeout_s,
        node_ttl_s=a.node_ttl_s,
        node_suspect_s=a.node_suspect_s,
        liveness_max_gap_s=a.liveness_max_gap_s,
        expire_max_fraction=a.expire_max_fraction,
        high_watermark=a.high_watermark,
        evict_ratio=a.evict_ratio,
        max_objects=a.max_objects,
        handshake_timeout_s=a.handshake_timeout_s,
        idle_timeout_s=a.idle_timeout_s,
        max_unauthenticated=a.max_unauthenticated,
        max_inflight=a.max_inflight,
        max_segments=a.max_segments,
        prefix_round_keys=a.prefix_round_keys,
        session_limits=SessionLimits(
            max_sessions=a.max_sessions, max_result_bytes=a.max_session_result_bytes
        ),
        request_timeout_s=a.request_timeout_s,
        metrics_port=a.metrics_port,
        snapshot_keys=a.snapshot_keys,
    )


def main(argv: list[str] | None = None) -> int:
    import sys

    a = build_arg_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, a.log_level.upper(), logging.WARNING),
        format=f"%(asctime)s master{a.id} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        cfg = config_from_args(a)
        if cfg.durability == "disk" and not cfg.data_dir:
            raise ValueError("--durability disk needs --dir")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.data_dir:
        os.makedirs(cfg.data_dir, exist_ok=True)
    # The cyclic GC's young generation every 20,000 container allocations, not 700: a
    # 512-key batch allocates hundreds of lists, structs and futures that live across the
    # log round trip, and at 700 the GC rescans them several times per batch (~3-4 % of a
    # replica's CPU per key in the metadata bench). The master's records are gc=False
    # structs, so nothing long-lived is added to the scans; a young collection scans only
    # what is still alive (~0.9 ms measured if all 20,000 were, under load).
    gc.set_threshold(20_000, 10, 10)
    try:
        return eventloop.run(run_master(cfg))  # uvloop unless KVMESH_EVENT_LOOP says
    except OSError as e:
        print(f"error: master {cfg.node_id} cannot start: {e}", file=sys.stderr)
        return 5


if __name__ == "__main__":
    import sys

    sys.exit(main())
