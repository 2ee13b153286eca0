"""The asyncio driver: runs one replica's :class:`~kvmesh.replog.core.raft.RaftCore` against a
real clock, a TCP transport, durable storage and the application's state machine.

One event loop per replica. The driver:

* turns ``time.monotonic()`` into ``core.tick()`` (missed ticks after a stall are caught
  up, so tick-based leases never outlive real time);
* runs the Ready loop through :class:`~kvmesh.replog.readypath.ReadyPath` (the ordering the
  simulator runs too): write the snapshot/entries/hard state (page cache) -> send
  ``send_now`` -> **one** fdatasync in a worker thread (group commit; messages and
  proposals keep being stepped in meanwhile and form the next batch) -> send
  ``send_after_persist`` -> restore/apply -> ``advance``;
* resolves proposals only after their entry is committed **and** applied, with the state
  machine's result; a proposal whose index got a different entry fails with
  :class:`ProposalLost` (definitely not applied), a timeout with :class:`ProposalTimeout`
  (outcome unknown: retry with the same ``(client_id, seq)``);
* serves linearizable reads through read-index (or the leader lease when configured):
  :meth:`RaftNode.read_index` returns once the local state machine reflects every write
  acknowledged before the call;
* takes snapshots past ``snapshot_threshold`` entries (shallow copy now, chunks encoded
  between loop iterations, each written to the file in a thread while the next one is
  encoded: the image is never held whole) and compacts, keeping
  ``trailing_logs`` entries for slightly lagging followers;
* wraps the application's state machine in
  :class:`~kvmesh.replog.session.SessionStateMachine` (exactly-once commands).

An I/O failure of the log (write or fsync error, corruption) is fatal: the node stops,
fails every waiter with :class:`NodeStopped`, and :attr:`RaftNode.fatal_error` says why.

``durability="memory"`` keeps the log in memory only (tests, caches, benchmarks): a
majority crash then loses acknowledged writes. It is named loudly on purpose.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import heapq
import inspect
import itertools
import logging
import os
import random
import secrets
import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from ..net import SecurityConfig
from ..net.addr import parse_peers
from .core.raft import RaftCore
from .errors import (
    CommandError,
    NodeStopped,
    NotLeaderError,
    ProposalLost,
    ProposalTimeout,
    ReadTimeout,
    ResultEvicted,
    SessionDenied,
    SessionExpiredError,
)
from .net.protocol import SESSION_TOKEN_BYTES
from .net.transport import Transport, TransportConfig
from .readypath import APPLY_SLICE_BYTES, SYNC, SYNC_BEGIN, YIELD, ReadyPath
from .session import (
    Command,
    Expire,
    Plain,
    Register,
    SessionLimits,
    SessionRejected,
    SessionStateMachine,
    SessionTracker,
    encode_envelope,
)
from .storage.disk import DiskStorage
from .storage.memory import MemoryStorage
from .types import (
    NONE,
    ConfChange,
    ConfChangeType,
    EntryKind,
    InstallSnapshot,
    NotLeader,
    RaftConfig,
    Ready,
    ReplogError,
    Role,
    Snapshot,
    SnapshotMeta,
    StateMachine,
    StorageError,
    decode_conf_change,
)

__all__ = [
    "DEFAULT_RAFT",
    "CommandError",
    "LeaderChange",
    "NodeConfig",
    "NodeStopped",
    "NotLeaderError",
    "ProposalLost",
    "ProposalTimeout",
    "RaftNode",
    "ReadTimeout",
    "SessionExpiredError",
    "parse_peers",
]

log = logging.getLogger(__name__)

DEFAULT_RAFT = RaftConfig(
    election_tick=10, max_election_tick=20, heartbeat_tick=1, max_committed_size_per_ready=8 << 20
)
"""With the default 100 ms tick: heartbeats every 100 ms, elections after 1-2 s (docs/replog.md,
"Running a cluster": heartbeat << election timeout << MTBF)."""


_APPLY_SLICE = 1000
_APPLY_SLICE_BYTES = APPLY_SLICE_BYTES  # readypath.py: why
_READY_TURN_S = 0.01  # Readies handled back to back before the loop gets a turn
# SessionRejected reasons -> the error the proposer gets (others: SessionExpiredError)
_REJECTED: dict[str, type[SessionExpiredError] | type[SessionDenied]] = {
    "bad_token": SessionDenied,
    "result_evicted": ResultEvicted,
}


class LeaderChange(msgspec.Struct, frozen=True):
    """Passed to leadership callbacks: the new leader (``NONE`` = unknown), the term, and
    whether this node is now the leader."""

    leader_id: int
    term: int
    is_self: bool


class NodeConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Configuration of one replica.

    * ``peers``: raft address ``host:port`` of every member, this node included.
    * ``client_addrs``: optional address of each member's client endpoint, returned in
      :class:`NotLeaderError` redirects (default: the raft address).
    * ``durability``: ``"disk"`` (WAL + fsync, needs ``data_dir``) or ``"memory"``.
    * ``join``: start without bootstrapping (a member being added to a running cluster).
    * ``security``: the cluster token and optional TLS files; replica connections
      authenticate with it (:mod:`kvmesh.net`, service ``"replog-peer"``).
    """

    node_id: int
    peers: dict[int, str]
    client_addrs: dict[int, str] = {}
    data_dir: str | None = None
    durability: Literal["disk", "memory"] = "disk"
    join: bool = False
    tick_s: float = 0.1
    raft: RaftConfig = DEFAULT_RAFT
    snapshot_threshold: int = 50_000
    trailing_logs: int = 10_000
    # ...and at most this many bytes of them: a batch entry holds thousands of keys, so
    # 10,000 entries can be the whole log (every object's key twice, held in memory)
    trailing_log_bytes: int = 16 << 20
    proposal_timeout_s: float = 10.0
    read_timeout_s: float = 5.0
    session_ttl_s: float = 0.0  # 0: sessions never expire
    # Live sessions and cached results: carried by this node's Register entries (docs/replog.md)
    session_limits: SessionLimits = SessionLimits()
    wal_segment_bytes: int = 64 << 20
    transport: TransportConfig = TransportConfig()
    security: SecurityConfig = SecurityConfig()

    def __post_init__(self) -> None:
        if self.node_id not in self.peers:
            raise ValueError(f"node {self.node_id} is not in peers {sorted(self.peers)}")
        if self.durability not in ("disk", "memory"):
            raise ValueError(f"durability must be 'disk' or 'memory', got {self.durability!r}")
        if self.durability == "disk" and not self.data_dir:
            raise ValueError("durability='disk' needs data_dir")
        if self.tick_s <= 0:
            raise ValueError("tick_s must be positive")
        if self.trailing_logs < 0 or self.snapshot_threshold <= 0 or self.trailing_log_bytes < 0:
            raise ValueError(
                "snapshot_threshold must be > 0, trailing_logs and trailing_log_bytes >= 0"
            )
        if min(msgspec.structs.astuple(self.session_limits)) <= 0:
            raise ValueError(f"session limits must be positive: {self.session_limits}")


class _Pending:
    __slots__ = ("fut", "term", "seq")

    def __init__(self, term: int, fut: asyncio.Future, seq: int) -> None:
        self.term = term
        self.fut = fut
        self.seq = seq  # which _track call made it: the deadline heap names it by this


class RaftNode:
    """One replica. Create, ``await start()``, use, ``await stop()``.

    ``state_machine`` implements :class:`~kvmesh.replog.types.StateMachine` (the whole
    contract: ``snapshot_chunks()`` makes snapshots non-blocking, ``result_type`` types
    cached results, ``query`` serves the replica server's reads;
    :class:`~kvmesh.replog.types.StateMachineBase` has defaults); the node wraps it for
    exactly-once sessions. ``state_machine`` must be fresh: the node restores it from the
    newest snapshot on start. A snapshot received from the leader is first restored into a
    new machine from ``state_machine_factory`` (default: the machine's class called without
    arguments, if that works) in a worker thread; only if that succeeds is it stepped into
    the core, persisted, and restored into the live machine (in place: references to it
    stay valid). A bad image is dropped, never fatal.
    """

    def __init__(
        self,
        config: NodeConfig,
        state_machine: StateMachine,
        *,
        rng: random.Random | None = None,
        state_machine_factory: Callable[[], StateMachine] | None = None,
    ) -> None:
        self.cfg = config
        self.id = config.node_id
        self.user_sm = state_machine
        self.sm = SessionStateMachine(state_machine)
        # A snapshot from the leader is restored into a fresh machine (made here) before it
        # is persisted; the current one stays in use until the new one is proven.
        self._sm_factory = state_machine_factory or _default_factory(state_machine)
        self._snap_check: asyncio.Task | None = None
        self._proven: tuple[int, int] | None = None  # (index, term) of the proven snapshot
        self._rng = rng
        self.storage: DiskStorage | MemoryStorage | None = None
        self.core: RaftCore | None = None
        self._path: ReadyPath | None = None
        self.transport: Transport | None = None
        self._wake = asyncio.Event()
        self._pending: dict[int, _Pending] = {}
        # (deadline, _Pending.seq, index): no future in it, so a proposal answered long
        # before its deadline does not keep its result alive (and in the cyclic GC's scans)
        # until then.
        self._deadlines: list[tuple[float, int, int]] = []
        self._deadline_seq = itertools.count()
        self._reads: dict[bytes, asyncio.Future] = {}
        self._apply_waiters: list[tuple[int, asyncio.Future]] = []
        self._read_ctx = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._leader_cbs: list[Callable[[LeaderChange], Any]] = []
        self._leader = NONE
        self._term = 0
        self._applied = 0
        self._snap_index = 0
        # The last index of the log as this replica found it at start (0 before start): its
        # own replay runs up to here. The store defers snapshots by keys until then.
        self.recovered_index = 0
        self._alone = False  # until it first leads: a lone voter campaigns without a timeout
        self._snapshotting = False
        self._running = False
        # A Ready is being handled (by the Ready loop, or begun inline and handed to it):
        # no other may start until it is advanced.
        self._in_ready = False
        self._inline = config.durability == "memory"  # see _proposed
        self._handoff: tuple[Any, Any] | None = None  # (path generator, its pending effect)
        self._stopped = asyncio.Event()
        self.fatal_error: BaseException | None = None
        ttl, lim = config.session_ttl_s, config.session_limits
        self.tracker = SessionTracker(ttl, lim.max_sessions) if ttl > 0 else None
        self._tick_epoch = 0.0
        self._ticks_done = 0
        self._lag_max = 0.0
        self._lags: collections.deque[float] = collections.deque(maxlen=1024)
        self.metrics = {
            "readies": 0,
            "fsyncs": 0,
            "early_sends": 0,
            "entries_persisted": 0,
            "entries_applied": 0,
            "proposals": 0,
            "snapshots_taken": 0,
            "snapshots_installed": 0,
            "snapshots_rejected": 0,
            "lease_reads": 0,  # read_index answered from the leader lease without a Ready
        }

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Recover storage and state machine, start the transport, timers and Ready loop."""
        cfg = self.cfg
        voters = sorted(cfg.peers)
        t0 = time.perf_counter()
        if cfg.durability == "disk":
            assert cfg.data_dir is not None
            self.storage = await asyncio.to_thread(
                DiskStorage.open,
                cfg.data_dir,
                bootstrap_voters=None if cfg.join else voters,
                segment_bytes=cfg.wal_segment_bytes,
            )
            self.storage.defer_pruning = True
        else:
            log.warning(
                "replog node %d: durability='memory' - the log is NOT persisted; a majority crash "
                "loses acknowledged writes",
                self.id,
            )
            self.storage = MemoryStorage() if cfg.join else MemoryStorage.bootstrap(voters)
        t_open = time.perf_counter() - t0
        self.recovered_index = self.storage.last_index()
        snap = self.storage.snapshot()
        snap_index = snap.meta.index
        if snap_index:
            t1 = time.perf_counter()
            self.sm.restore(snap.data)
            log.info(
                "replog node %d: storage opened in %.2fs, snapshot at %d (%d bytes) restored in"
                " %.2fs; %d log entries after it",
                self.id,
                t_open,
                snap_index,
                len(snap.data),
                time.perf_counter() - t1,
                self.storage.last_index() - snap_index,
            )
            # The image is in the file; a follower that needs it gets it read back from there.
            release = getattr(self.storage, "release_snapshot_data", None)
            if release is not None:
                release()
        del snap
        if snap_index:
            # The restored image is long-lived: keep the cyclic GC from rescanning it.
            gc.collect()
            gc.freeze()
        self._applied = self._snap_index = snap_index
        self.restore_s = time.perf_counter() - t0
        # Election timeouts come from OS randomness unless a caller (a test) passes a seeded
        # RNG: the core's default, Random(node_id), would repeat the same timeout sequence
        # on every restart and keep colliding with a peer that does the same.
        rng = self._rng if self._rng is not None else random.Random(os.urandom(16))
        self.core = RaftCore(self.id, self.storage, cfg.raft, rng, applied=self._applied)
        self._path = ReadyPath(self.core, self.storage, self, _APPLY_SLICE, _APPLY_SLICE_BYTES)
        self._term = self.core.term
        listen = cfg.peers[self.id]
        self.transport = Transport(
            self.id,
            listen,
            cfg.peers,
            self._on_message,
            on_unreachable=self._on_unreachable,
            on_snapshot_status=self._on_snapshot_status,
            config=cfg.transport,
            security=cfg.security,
        )
        try:
            await self.transport.start()
        except BaseException:
            # E.g. the address is in use: release the data directory before failing.
            self.storage.close()
            self.storage = None
            raise
        self._running = True
        self._tick_epoch = time.monotonic()
        self._ticks_done = 0
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._ready_loop(), name=f"replog-{self.id}-ready"),
            loop.create_task(self._tick_loop(), name=f"replog-{self.id}-tick"),
        ]
        if self.tracker is not None:
            self._tasks.append(
                loop.create_task(self._expiry_loop(), name=f"replog-{self.id}-expiry")
            )
        self._alone = True
        self._campaign_alone()
        self._wake.set()

    async def stop(self) -> None:
        """Stop timers, transport and loop; fail all waiters; close storage. Idempotent."""
        if not self._running and self.storage is None:
            return
        self._running = False
        me = asyncio.current_task()
        for t in self._tasks:
            if t is not me:
                t.cancel()
        for t in self._tasks:
            if t is not me:
                try:
                    await t
                except BaseException:  # noqa: BLE001 - shutting down
                    pass
        self._tasks = []
        if self.transport is not None:
            await self.transport.stop()
        self._fail_all(
            NodeStopped(
                f"node {self.id} stopped" + (f": {self.fatal_error}" if self.fatal_error else "")
            )
        )
        if self.storage is not None:
            try:
                # A WAL that failed an fsync refuses to sync again and just closes.
                self.storage.close()
            except Exception as e:  # noqa: BLE001
                log.error("replog node %d: closing storage: %s", self.id, e)
        self.storage = None
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def _fail_all(self, exc: BaseException) -> None:
        for p in self._pending.values():
            if not p.fut.done():
                p.fut.set_exception(exc)
        self._pending.clear()
        self._deadlines.clear()
        for f in self._reads.values():
            if not f.done():
                f.set_exception(exc)
        self._reads.clear()
        for _, f in self._apply_waiters:
            if not f.done():
                f.set_exception(exc)
        self._apply_waiters.clear()

    def _fatal(self, exc: BaseException) -> None:
        if self.fatal_error is None:
            self.fatal_error = exc
            log.critical("replog node %d: fatal: %s; stopping", self.id, exc)
        asyncio.get_running_loop().create_task(self.stop())

    # ------------------------------------------------------------------ public API

    @property
    def leader_id(self) -> int | None:
        return self._leader or None

    @property
    def is_leader(self) -> bool:
        return self.core is not None and self.core.role == Role.LEADER

    @property
    def term(self) -> int:
        return self._term

    @property
    def applied_index(self) -> int:
        return self._applied

    @property
    def state_machine(self) -> StateMachine:
        """The application's state machine (read it after :meth:`read_index`)."""
        return self.user_sm

    def address_of(self, node_id: int | None) -> str | None:
        if not node_id:
            return None
        return self.cfg.client_addrs.get(node_id) or self.cfg.peers.get(node_id)

    def on_leader_change(self, cb: Callable[[LeaderChange], Any]) -> None:
        """Call ``cb(LeaderChange)`` (a function or coroutine function) whenever the known
        leader changes. The store master starts its lease grace period when ``is_self``."""
        self._leader_cbs.append(cb)

    def status(self) -> dict[str, Any]:
        core = self._core()
        st = core.status()
        return {
            "id": self.id,
            "role": Role(st.role).name,
            "term": st.term,
            "leader": st.leader,
            "commit": st.commit,
            "applied": self._applied,
            "first_index": st.first_index,
            "last_index": st.last_index,
            "snapshot_index": self._snap_index,
            "voters": list(st.conf_state.voters),
            "learners": list(st.conf_state.learners),
            "sessions": len(self.sm.sessions),
            "session_result_bytes": self.sm.result_bytes,
            "loop_lag_max_s": self._lag_max,
            "loop_lag_p99_s": sorted(self._lags)[int(0.99 * (len(self._lags) - 1))]
            if self._lags
            else 0.0,
            "durability": self.cfg.durability,
            # Hostile-input counters: messages the core refused, forged senders and bad
            # frames/connections the transport dropped.
            "core_dropped_msgs": core.dropped_msgs,
            "forged_msgs": self.transport.forged_msgs if self.transport is not None else 0,
            "peer_bad_frames": self.transport.bad_frames if self.transport is not None else 0,
            "peer_refused_handshakes": (
                self.transport.refused_handshakes if self.transport is not None else 0
            ),
            **self.metrics,
        }

    def reset_lag_stats(self) -> None:
        """Forget event-loop lag samples (to measure a window, e.g. around a snapshot)."""
        self._lag_max = 0.0
        self._lags.clear()

    def _core(self) -> RaftCore:
        if self.core is None or not self._running:
            raise NodeStopped(
                f"node {self.id} is not running"
                + (f": {self.fatal_error}" if self.fatal_error else "")
            )
        return self.core

    def _not_leader(self, hint: int | None) -> NotLeaderError:
        hint = hint or self._leader or None
        if hint == self.id:
            hint = None
        return NotLeaderError(hint, self.address_of(hint))

    async def propose(
        self,
        cmd: bytes,
        client_id: int | None = None,
        seq: int | None = None,
        ack: int = 0,
        timeout: float | None = None,
    ) -> Any:
        """Replicate ``cmd`` and return the state machine's result once it is committed and
        applied here. With ``client_id``/``seq`` (from :meth:`register_session`) the command
        is applied exactly once however often it is retried, on any replica."""
        return await self.propose_nowait(cmd, client_id, seq, ack, timeout)

    def propose_nowait(
        self,
        cmd: bytes,
        client_id: int | None = None,
        seq: int | None = None,
        ack: int = 0,
        timeout: float | None = None,
        token: bytes = b"",
    ) -> asyncio.Future:
        """:meth:`propose` without a coroutine: appends now (raising NotLeaderError etc.
        immediately) and returns a future of the result (for RPC layers that answer from a
        done-callback instead of spawning a task per request). ``token``: the session's,
        from :meth:`open_session` (a wrong one fails with SessionDenied, nothing applied)."""
        if client_id is None:
            data = encode_envelope(Plain(cmd))
        else:
            if seq is None or seq <= 0:
                raise ValueError("seq must be a positive int with client_id")
            data = encode_envelope(Command(client_id, seq, cmd, ack, token))
            if self.tracker is not None and self.is_leader:
                self.tracker.touch(client_id, time.monotonic())
        return self._submit(data, timeout)

    async def propose_many(
        self, cmds: list[tuple[bytes, int | None, int | None, int]], timeout: float | None = None
    ) -> list[Any]:
        """Propose several ``(cmd, client_id, seq, ack)`` at once (one batch, one fsync);
        results (or exceptions) in order."""
        datas = []
        for cmd, cid, seq, ack in cmds:
            if cid is None:
                datas.append(encode_envelope(Plain(cmd)))
            else:
                datas.append(encode_envelope(Command(cid, seq or 0, cmd, ack)))
        core = self._core()
        try:
            last = core.propose_many(datas)
        except NotLeader as e:
            raise self._not_leader(e.leader_hint) from None
        self.metrics["proposals"] += len(datas)
        futs = [
            self._track(idx, core.term, timeout) for idx in range(last - len(datas) + 1, last + 1)
        ]
        self._proposed()
        return list(await asyncio.gather(*futs, return_exceptions=True))

    async def register_session(self, timeout: float | None = None) -> int:
        """Open an exactly-once session without a token (in-process callers); returns the
        client id to use with :meth:`propose`."""
        cid = await self._propose_data(self._register(b""), timeout)
        if self.tracker is not None:
            self.tracker.touch(cid, time.monotonic())
        return cid

    async def open_session(self, timeout: float | None = None) -> tuple[int, bytes]:
        """Open a session protected by a fresh random token (for sessions of remote
        clients): returns ``(client_id, token)``; every command must carry the token."""
        token = secrets.token_bytes(SESSION_TOKEN_BYTES)
        cid = await self._propose_data(self._register(token), timeout)
        if self.tracker is not None:
            self.tracker.touch(cid, time.monotonic())
        return cid, token

    def _register(self, token: bytes) -> bytes:
        # The limits travel in the entry: every replica applies the same ones.
        return encode_envelope(Register(token, *msgspec.structs.astuple(self.cfg.session_limits)))

    def session_token(self, client_id: int) -> bytes | None:
        """The token of an applied session (None if not known on this replica yet)."""
        return self.sm.session_token(client_id)

    async def _propose_data(self, data: bytes, timeout: float | None) -> Any:
        return await self._submit(data, timeout)

    def _submit(self, data: bytes, timeout: float | None) -> asyncio.Future:
        core = self._core()
        try:
            idx = core.propose(data)
        except NotLeader as e:
            raise self._not_leader(e.leader_hint) from None
        self.metrics["proposals"] += 1
        fut = self._track(idx, core.term, timeout)
        self._proposed()
        return fut

    def _proposed(self) -> None:
        """After a proposal was appended to the core (its future tracked). With a memory log
        the Readies it makes are handled here and now, in the proposer's call: there is no
        fsync to share with proposals still to come, so waiting for the Ready loop's turn
        only costs two more event-loop wake-ups per request (the loop's, then the
        proposer's on its resolved future). A single voter commits and applies the entry
        before this returns (the proposer's ``await`` then does not suspend); with peers,
        the appends go out now. The ordering is the one :class:`ReadyPath` path: a Ready
        whose path needs I/O or a yield (a snapshot, a long apply) is handed to the Ready
        loop where it stands, and none starts while another is unfinished."""
        if self._inline and not self._in_ready and self._running:
            self._drain_inline()
        else:
            self._wake.set()

    def _drain_inline(self) -> None:
        core = self.core
        path = self._path
        assert core is not None and path is not None
        self._in_ready = True
        try:
            while self._running and core.has_ready():
                gen = self._begin_ready(core.ready())
                try:
                    eff = gen.send(None)
                except StopIteration:
                    self._after_ready()
                    continue
                self._handoff = (gen, eff)  # the Ready loop performs it and finishes the path
                self._wake.set()
                return
        except BaseException as e:  # noqa: BLE001 - storage/apply failures are fatal
            self._fatal(e)
        self._in_ready = False

    def _track(self, idx: int, term: int, timeout: float | None) -> asyncio.Future:
        """A future resolved when index ``idx`` is applied (or times out)."""
        fut = asyncio.get_running_loop().create_future()
        old = self._pending.get(idx)
        if old is not None and not old.fut.done():
            # We lead now and our log holds a different entry at idx: the old one is gone.
            old.fut.set_exception(
                ProposalLost(f"index {idx} was taken by a proposal of term {term}")
            )
        seq = next(self._deadline_seq)
        self._pending[idx] = _Pending(term, fut, seq)
        t = self.cfg.proposal_timeout_s if timeout is None else timeout
        # One heap swept by the tick loop instead of a timer per proposal.
        heapq.heappush(self._deadlines, (time.monotonic() + t, seq, idx))
        return fut

    def _expire_proposals(self, now: float) -> None:
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            _, seq, idx = heapq.heappop(dl)
            p = self._pending.get(idx)
            if p is None or p.seq != seq:
                continue  # answered (or replaced) before its deadline
            del self._pending[idx]
            if p.fut.done():
                continue
            p.fut.set_exception(
                ProposalTimeout(
                    f"no result for the proposal at index {idx} in time (outcome unknown)"
                )
            )

    def lease_read_index(self) -> int | None:
        """:meth:`read_index` answered now, without waiting, when this leader holds a read
        lease and has applied its commit index (the common lease read): the index the core
        would report in its next Ready, minus the round trip through the Ready loop. None
        if the barrier needs that round trip (or a quorum); raises NodeStopped."""
        core = self._core()
        self._catch_up_ticks()  # a lease must be judged against real time, not a stale tick count
        if not core.lease_valid():
            return None
        index = core.log.committed
        if self._applied < index:
            return None
        self.metrics["lease_reads"] += 1
        return index

    async def read_index(self, timeout: float | None = None) -> int:
        """Linearizable read barrier: returns an index such that the local state machine,
        now applied at least that far, reflects every write acknowledged before this call.
        Works on followers too (they ask the leader). Raises NotLeaderError/ReadTimeout."""
        index = self.lease_read_index()
        if index is not None:
            return index
        core = self._core()
        ctx = next(self._read_ctx).to_bytes(8, "little")
        fut = asyncio.get_running_loop().create_future()
        # Remember whom the request went to: the core drops it if that leadership ends.
        fut.replog_leader = (core.lead, core.term)  # type: ignore[attr-defined]
        self._reads[ctx] = fut
        try:
            core.read_index(ctx)
        except NotLeader as e:
            del self._reads[ctx]
            raise self._not_leader(e.leader_hint) from None
        self._wake.set()
        t = self.cfg.read_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + t
        try:
            index = await asyncio.wait_for(fut, t)
        except TimeoutError:
            raise ReadTimeout(f"read index not confirmed within {t}s") from None
        finally:
            self._reads.pop(ctx, None)
        await self.wait_applied(index, max(0.0, deadline - time.monotonic()))
        return index

    async def linearizable_read(
        self, fn: Callable[[StateMachine], Any], timeout: float | None = None
    ) -> Any:
        """``fn(state_machine)`` after a :meth:`read_index` barrier."""
        await self.read_index(timeout)
        return fn(self.user_sm)

    async def wait_applied(self, index: int, timeout: float | None = None) -> None:
        """Wait until the state machine has applied ``index``."""
        if self._applied >= index:
            return
        fut = asyncio.get_running_loop().create_future()
        self._apply_waiters.append((index, fut))
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise ReadTimeout(
                f"index {index} not applied in time (applied {self._applied})"
            ) from None

    async def transfer_leadership(self, to: int, timeout: float = 5.0) -> None:
        """Hand leadership to ``to`` and wait until it leads (or raise ReadTimeout)."""
        core = self._core()
        try:
            core.transfer_leader(to)
        except NotLeader as e:
            raise self._not_leader(e.leader_hint) from None
        self._wake.set()
        deadline = time.monotonic() + timeout
        while self._leader != to:
            if time.monotonic() > deadline:
                raise ReadTimeout(f"leadership did not move to {to} within {timeout}s")
            await asyncio.sleep(self.cfg.tick_s / 2)

    async def change_membership(self, cc: ConfChange, timeout: float | None = None) -> None:
        """Propose a single-server membership change and wait until it is applied. For
        ADD_VOTER/ADD_LEARNER put the new member's raft address in ``cc.context``."""
        core = self._core()
        try:
            idx = core.propose_conf_change(cc)
        except NotLeader as e:
            raise self._not_leader(e.leader_hint) from None
        fut = self._track(idx, core.term, timeout)
        self._wake.set()
        await fut

    async def snapshot_now(self) -> int:
        """Take a snapshot at the current applied index (returns it; 0 if one is running)."""
        self._core()
        if self._snapshotting or self._applied <= self._snap_index:
            return 0
        return await self._take_snapshot()

    # ------------------------------------------------------------------ inputs

    def _on_message(self, msg: Any) -> None:
        if self.core is None or not self._running:
            return
        # After a stall (GC, blocked loop, SIGSTOP) the missed ticks must land before any
        # message is stepped: a leader answering a follower's ReadIndex from a lease it
        # measured in stale ticks would serve a stale read (simulator scenario E3).
        self._catch_up_ticks()
        if (
            type(msg) is InstallSnapshot
            and self._sm_factory is not None
            and self.core.snapshot_needed(msg)
        ):
            meta = msg.snapshot.meta
            if self._proven != (meta.index, meta.term):
                self._check_snapshot(msg)
                return
        try:
            self.core.step(msg)
        except Exception:
            log.exception(
                "replog node %d: core rejected %s from %d", self.id, type(msg).__name__, msg.frm
            )
        self._wake.set()

    def _check_snapshot(self, msg: InstallSnapshot) -> None:
        """Restore ``msg``'s image into a fresh state machine (in a worker thread); step the
        message into the core only if that succeeds. One check at a time: the leader
        re-sends a snapshot that got no answer, so dropping extra copies is safe."""
        if self._snap_check is not None and not self._snap_check.done():
            return
        self._snap_check = asyncio.get_running_loop().create_task(
            self._prove_snapshot(msg), name=f"replog-{self.id}-snapcheck"
        )

    async def _prove_snapshot(self, msg: InstallSnapshot) -> None:
        meta = msg.snapshot.meta
        assert self._sm_factory is not None
        try:
            fresh = SessionStateMachine(self._sm_factory(), self.sm.max_results)
            await asyncio.to_thread(fresh.restore, msg.snapshot.data)
            del fresh  # only the proof was needed: free the second image now
        except Exception as e:  # noqa: BLE001 - a peer's bytes must never stop the node
            self.metrics["snapshots_rejected"] += 1
            n = self.metrics["snapshots_rejected"]
            if n <= 10 or n % 100 == 0:  # bounded logging under a flood
                log.warning(
                    "replog node %d: rejected snapshot at index %d term %d from node %d"
                    " (%d so far): %s",
                    self.id, meta.index, meta.term, msg.frm, n, str(e)[:200],
                )  # fmt: skip
            return
        if self.core is None or not self._running:
            return
        self._proven = (meta.index, meta.term)
        self._on_message(msg)

    def _on_unreachable(self, peer: int) -> None:
        if self.core is not None and self._running:
            self.core.report_unreachable(peer)

    def _on_snapshot_status(self, peer: int, ok: bool) -> None:
        if self.core is not None and self._running:
            self.core.report_snapshot(peer, ok)
            self._wake.set()

    def _catch_up_ticks(self) -> None:
        core = self.core
        if core is None:
            return
        now = time.monotonic()
        due = int((now - self._tick_epoch) / self.cfg.tick_s)
        n = due - self._ticks_done
        if n <= 0:
            return
        # After a long stall every timeout has expired anyway; more ticks change nothing
        # (the cap is far above the lease length, so leases stay conservative).
        cap = 4 * self.cfg.raft.election_range[1]
        if n > cap:
            self._ticks_done = due - cap
            n = cap
        for _ in range(n):
            core.tick()
        self._ticks_done += n
        self._campaign_alone()
        self._wake.set()

    def _campaign_alone(self) -> None:
        """A replica that is the only voter campaigns at once, from its start until it first
        leads: there is no one to hear from or collide with, so an election timeout (0.5-1 s
        at the store's ticks) would only delay every restart. The core refuses while
        committed configuration entries are still unapplied (a fresh log's first entry, a
        replay's); a later tick asks again."""
        core = self.core
        if not self._alone or core is None:
            return
        if core.role == Role.LEADER or core.voters not in ((), (self.id,)):
            self._alone = False  # () until a fresh log's configuration entry is applied
            return
        core.campaign()

    async def _tick_loop(self) -> None:
        tick = self.cfg.tick_s
        while self._running:
            nxt = self._tick_epoch + (self._ticks_done + 1) * tick
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            # How late this wakeup is: the event-loop stall (GC, long encodes, blocking
            # calls) that elections and leases must absorb.
            lag = max(0.0, time.monotonic() - nxt)
            self._lags.append(lag)
            self._lag_max = max(self._lag_max, lag)
            self._catch_up_ticks()
            if self._deadlines:
                self._expire_proposals(time.monotonic())

    async def _expiry_loop(self) -> None:
        assert self.tracker is not None
        period = max(self.cfg.session_ttl_s / 4, self.cfg.tick_s)
        while self._running:
            await asyncio.sleep(period)
            if not self.is_leader:
                continue
            idle = self.tracker.idle(time.monotonic())
            if not idle:
                continue
            try:
                await self._propose_data(encode_envelope(Expire(idle)), None)
                self.tracker.forget(idle)
            except ReplogError as e:
                log.info("replog node %d: session expiry not committed: %s", self.id, e)

    # ------------------------------------------------------------------ Ready loop

    async def _ready_loop(self) -> None:
        core = self.core
        assert core is not None
        try:
            while self._running:
                await self._wake.wait()
                self._wake.clear()
                handoff, self._handoff = self._handoff, None
                if handoff is not None:  # a Ready begun inline (_proposed) comes first
                    await self._run_path(*handoff)
                    self._in_ready = False
                t0 = time.monotonic()
                while self._running and core.has_ready():
                    self._in_ready = True
                    await self._handle_ready(core.ready())
                    self._in_ready = False
                    if time.monotonic() - t0 >= _READY_TURN_S and core.has_ready():
                        # A Ready without I/O (a replay, a follower catching up) never
                        # suspends: back to back they held the loop for a whole 10 M-object
                        # replay (6.3 s). Let requests and timers run, then go on.
                        self._wake.set()
                        await asyncio.sleep(0)
                        break
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - storage/apply failures are fatal
            self._fatal(e)

    def _begin_ready(self, rd: Ready) -> Any:
        self.metrics["readies"] += 1
        self.metrics["entries_persisted"] += len(rd.entries_to_append)
        assert self._path is not None
        return self._path.run(rd)

    def _after_ready(self) -> None:
        if (
            not self._snapshotting
            and self._applied - self._snap_index >= self.cfg.snapshot_threshold
        ):
            self._snapshotting = True
            asyncio.get_running_loop().create_task(self._snapshot_task())

    async def _handle_ready(self, rd: Ready) -> None:
        """Run the shared Ready path, performing its effects with asyncio: the fsync and
        file writes in worker threads (the loop keeps stepping messages meanwhile)."""
        gen = self._begin_ready(rd)
        try:
            eff = gen.send(None)
        except StopIteration:
            self._after_ready()
            return
        await self._run_path(gen, eff)

    async def _run_path(self, gen: Any, eff: Any) -> None:
        """Perform ``eff`` (the effect ``gen`` stands at) and every later one, to the end."""
        storage = self.storage
        assert storage is not None
        syncing: asyncio.Future | None = None
        while True:
            result: Any = None
            if eff is SYNC_BEGIN:
                # The fsync runs in a worker thread while the path applies on the loop.
                syncing = asyncio.get_running_loop().run_in_executor(None, storage.sync)
            elif eff is SYNC:
                if syncing is None:
                    await asyncio.to_thread(storage.sync)
                else:
                    await self._sync_wait(syncing)
                    syncing = None
                self.metrics["fsyncs"] += 1
            elif eff is YIELD:
                await asyncio.sleep(0)
            else:
                result = await asyncio.to_thread(eff)
            try:
                eff = gen.send(result)
            except StopIteration:
                break
        self._after_ready()

    async def _sync_wait(self, fut: asyncio.Future) -> None:
        """Wait for a Ready's fsync. A leader meanwhile sends what new work (proposals,
        acknowledgements) made sendable at once (:meth:`RaftCore.take_send_now`): the
        entries proposed during its fsync reach the followers now, not after it."""
        core = self.core
        assert core is not None and self.transport is not None
        if core.voters == (self.id,) and not core.learners:
            # A lone voter has no one to send to early: one wait, not a wake-up race per
            # fsync (a future and a task each, on every durable commit).
            await fut
            return
        while not fut.done() and core.role == Role.LEADER:
            self._wake.clear()  # the Ready loop re-checks has_ready() after this Ready
            woke = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait((fut, woke), return_when=asyncio.FIRST_COMPLETED)
            finally:
                woke.cancel()
            msgs = core.take_send_now()
            if msgs:
                self.transport.send(msgs)
                self.metrics["early_sends"] += 1
        await fut

    # ReadyHost: what the shared path calls back.

    def send(self, msgs: list, after_persist: bool) -> None:
        assert self.transport is not None
        self.transport.send(msgs)

    def install(self, snap: Snapshot) -> None:
        self._install(snap)

    def apply(self, entries: list) -> None:
        self._apply(entries)

    def before_advance(self, rd: Ready) -> None:
        if rd.soft_state is not None:
            self._soft_state(rd.soft_state)
        for rs in rd.read_states:
            f = self._reads.get(rs.context)
            if f is not None and not f.done():
                f.set_result(rs.index)
        assert self.core is not None
        self._term = self.core.term

    def after_advance(self, rd: Ready) -> None:
        self._notify_applied()

    def _install(self, snap: Snapshot) -> None:
        # The image was proven on a fresh machine before the core could persist it (unless
        # the machine has no factory); restore the live one in place, so that embedders'
        # references to their state machine stay valid.
        self._proven = None
        self.sm.restore(snap.data)
        self._applied = self._snap_index = snap.meta.index
        release = getattr(self.storage, "release_snapshot_data", None)
        if release is not None:
            release()  # persisted already: the file has it
        self.metrics["snapshots_installed"] += 1
        # Pending proposals at or below the snapshot: their fate is unknown here.
        for idx in [i for i in self._pending if i <= snap.meta.index]:
            p = self._pending.pop(idx)
            if not p.fut.done():
                p.fut.set_exception(
                    ProposalTimeout(
                        f"index {idx} was covered by an installed snapshot; outcome unknown"
                    )
                )
        for cc_peer in snap.meta.conf_state.voters + snap.meta.conf_state.learners:
            if (
                cc_peer not in self.cfg.peers
                and self.transport is not None
                and cc_peer not in self.transport.peer_addresses()
            ):
                log.warning("replog node %d: member %d has no known address", self.id, cc_peer)

    def _apply(self, ents: list) -> None:
        sm = self.sm
        pending = self._pending
        for e in ents:
            idx = e.index
            p = pending.pop(idx, None) if pending else None
            if e.kind == EntryKind.CONF_CHANGE:
                self._conf_change(decode_conf_change(e.data))
                result: Any = None
                err: BaseException | None = None
            elif not e.data:
                result, err = None, None  # a new leader's no-op
            else:
                err = None
                try:
                    result = sm.apply(idx, e.data)
                except Exception as ex:  # noqa: BLE001 - deterministic on every replica
                    result, err = None, CommandError(f"{type(ex).__name__}: {ex}")
                    log.warning(
                        "replog node %d: state machine raised at index %d: %r", self.id, idx, ex
                    )
            self._applied = idx
            if p is None or p.fut.done():
                continue
            if p.term != e.term:
                p.fut.set_exception(
                    ProposalLost(
                        f"index {idx} was taken by an entry of term {e.term}, not {p.term}"
                    )
                )
            elif err is not None:
                p.fut.set_exception(err)
            elif type(result) is SessionRejected:
                cls = _REJECTED.get(result.reason, SessionExpiredError)
                p.fut.set_exception(
                    cls(f"client {result.client_id} seq {result.seq}: {result.reason}")
                )
            else:
                p.fut.set_result(result)
        self.metrics["entries_applied"] += len(ents)

    def _conf_change(self, cc: ConfChange) -> None:
        tr = self.transport
        if tr is None:
            return
        if cc.type in (ConfChangeType.ADD_VOTER, ConfChangeType.ADD_LEARNER) and cc.context:
            addr = cc.context.decode()
            if cc.node_id != self.id:
                tr.add_peer(cc.node_id, addr)
        elif cc.type == ConfChangeType.REMOVE_NODE and cc.node_id != self.id:
            tr.remove_peer(cc.node_id)

    def _notify_applied(self) -> None:
        if not self._apply_waiters:
            return
        applied = self._applied
        keep = []
        for index, f in self._apply_waiters:
            if index <= applied:
                if not f.done():
                    f.set_result(None)
            else:
                keep.append((index, f))
        self._apply_waiters = keep

    def _soft_state(self, ss: Any) -> None:
        old = self._leader
        self._leader = ss.leader
        if ss.leader == old:
            return
        core = self.core
        assert core is not None
        # The core drops unconfirmed read requests when the leadership they were sent to
        # ends: fail those now so callers retry instead of waiting for their timeout.
        exc = self._not_leader(ss.leader)
        current = (ss.leader, core.term)
        for f in self._reads.values():
            if not f.done() and f.replog_leader != current:
                f.set_exception(exc)
        is_self = ss.leader == self.id
        if is_self and self.tracker is not None:
            self.tracker.reset(self.sm.session_ids(), time.monotonic())
        change = LeaderChange(ss.leader, core.term, is_self)
        log.info(
            "replog node %d: leader is now %s (term %d)", self.id, ss.leader or "unknown", core.term
        )
        for cb in list(self._leader_cbs):
            try:
                r = cb(change)
                if inspect.isawaitable(r):
                    asyncio.ensure_future(r)
            except Exception:
                log.exception("replog node %d: leader-change callback failed", self.id)

    # ------------------------------------------------------------------ snapshots

    async def _snapshot_task(self) -> None:
        try:
            # Entries applied while a snapshot was written count toward the next one: take
            # it now, not at some later Ready (an idle replica may not see one for a while).
            while await self._take_snapshot() and (
                self._running and self._applied - self._snap_index >= self.cfg.snapshot_threshold
            ):
                pass
        except Exception as e:  # noqa: BLE001
            if isinstance(e, (OSError,)):
                self._fatal(e)
            else:
                log.warning("replog node %d: snapshot failed: %s", self.id, e)

    def _compact_point(self, storage: Any, index: int) -> int:
        """The index to compact to after a snapshot at ``index``: keep at most
        ``trailing_logs`` entries and ``trailing_log_bytes`` bytes of entries below it."""
        lo = max(storage.first_index(), index - self.cfg.trailing_logs + 1)
        if lo > index:
            return index - self.cfg.trailing_logs
        kept, cap = 0, self.cfg.trailing_log_bytes
        ents = storage.entries(lo, index + 1)
        for i in range(len(ents) - 1, -1, -1):
            kept += len(ents[i].data)
            if kept > cap:
                return ents[i].index
        return lo - 1

    async def _stream_snapshot(
        self, begin: Callable[[SnapshotMeta], Any], meta: SnapshotMeta, chunks: Any
    ) -> tuple[Any, int]:
        """Encode a chunk per loop iteration (on the loop: the image's copy-on-write works
        against the applies between them) and write each in a worker thread while the next
        is encoded: at most two chunks are held, whatever the image's size."""
        w = await asyncio.to_thread(begin, meta)
        size = 0
        pending: asyncio.Future | None = None
        try:
            for c in chunks:
                if pending is not None:
                    await pending
                size += len(c)
                pending = asyncio.ensure_future(asyncio.to_thread(w.write, c))
                del c
                await asyncio.sleep(0)
            if pending is not None:
                await pending
                pending = None
            return await asyncio.to_thread(w.finish), size
        except BaseException:
            if pending is not None:
                with contextlib.suppress(BaseException):
                    await pending
            await asyncio.to_thread(w.abort)
            raise

    async def _take_snapshot(self) -> int:
        self._snapshotting = True
        try:
            self._core()
            storage = self.storage
            path = self._path
            assert storage is not None and path is not None
            # Capture at one instant: the applied index, the configuration at exactly that
            # index (the path tracks it slice by slice; the core's lags until advance) and a
            # shallow image. Any await point lies between two apply slices.
            index, conf = path.snapshot_point()
            chunks = self.sm.snapshot_chunks()
            t0 = time.perf_counter()
            try:
                term = storage.term(index)
            except StorageError:
                return 0  # a snapshot from the leader replaced the log meanwhile
            meta = SnapshotMeta(index, term, conf)
            begin = getattr(storage, "begin_local_snapshot", None)
            if begin is not None:
                staged, size = await self._stream_snapshot(begin, meta, chunks)
            else:  # the storage keeps the image itself (memory): collect it
                parts = []
                for c in chunks:
                    parts.append(c)
                    await asyncio.sleep(0)  # encode one chunk per loop iteration
                size = sum(len(p) for p in parts)
                staged = await asyncio.to_thread(storage.stage_local_snapshot, meta, parts)
                del parts
            if self.storage is not storage or not storage.commit_local_snapshot(meta, staged):
                return 0
            # Deleting an old 60 MB file can take a while: not on the loop.
            doomed = storage.obsolete_snapshot_files()
            if doomed:
                await asyncio.to_thread(storage.remove_snapshot_files, doomed)
            self._snap_index = index
            compact_to = self._compact_point(storage, index)
            if compact_to >= storage.first_index():
                # The memory part on the loop (the log is the loop's); the segments' unlinks
                # and the directory fsync (31 ms at 1 M objects) in a worker.
                detached = getattr(storage, "compact_detached", None)
                if detached is None:
                    storage.compact(compact_to)
                else:
                    finish = detached(compact_to)
                    if finish is not None:
                        await asyncio.to_thread(finish)
            self.metrics["snapshots_taken"] += 1
            log.info(
                "replog node %d: snapshot at %d (%d bytes, %.3fs)",
                self.id,
                index,
                size,
                time.perf_counter() - t0,
            )
            return index
        finally:
            self._snapshotting = False


def _default_factory(sm: StateMachine) -> Callable[[], StateMachine] | None:
    """``type(sm)`` if it builds a machine without arguments, else None (then leader
    snapshots cannot be proven before they are persisted: pass ``state_machine_factory``)."""
    cls = type(sm)
    try:
        cls()
    except Exception:  # noqa: BLE001 - any constructor failure means "no default factory"
        log.warning(
            "replog: %s() needs arguments; pass state_machine_factory to RaftNode so that "
            "snapshots from the leader are proven before they are persisted",
            cls.__name__,
        )
        return None
    return cls
