"""Exactly-once client commands (Raft thesis §6.3) as a wrapper around any state machine.

Clients register once (a committed :class:`Register` entry; its log index becomes the
client id, so a session is never "resurrected" by a delayed duplicate registration), then
tag every command with ``(client_id, seq)``. The wrapper keeps, per session, the results of
commands whose replies the client may not have seen yet; a retried command gets the cached
result instead of being applied twice, on any replica, across leader changes and restarts
(the session table is part of the snapshot).

Pipelined clients are supported: ``ack`` in a :class:`Command` says "I have the replies of
every seq below this", letting the table drop those results. With one outstanding request
at a time this degrades to the thesis' ``client_id -> (last_seq, last_result)``.

Sessions end through a committed :class:`Expire` entry that the leader proposes
(:class:`SessionTracker` helps it choose), or when a :class:`Register` finds the table full:
it then ends the least-recently-used sessions in the same apply, the log index of each
session's last command being the recency clock. ``apply`` never reads a clock, so the table
is identical on every replica and across snapshot/restore. Cached results are bounded per
session (count and bytes) and in total; a result evicted by a bound (not acknowledged) is
answered :class:`SessionRejected` ``"result_evicted"`` on retry, never re-applied. The bounds
in force travel in committed :class:`Register` entries (see :class:`SessionLimits`), so
replicas whose configurations differ still agree. A command from an
unknown (expired or never registered) session is not applied; it returns
:class:`SessionRejected`, which clients must surface as "outcome unknown" for that command,
never retry blindly.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Iterator
from typing import Any

import crc32c
import msgspec

from .storage.snapfile import SnapshotCorruptionError, pack_chunk
from .types import StateMachine, snapshot_chunks_of

__all__ = [
    "MAX_RESULTS_PER_SESSION",
    "MAX_RESULT_BYTES",
    "MAX_RESULT_BYTES_TOTAL",
    "MAX_SESSIONS",
    "RESULT_OVERHEAD",
    "Command",
    "Envelope",
    "Expire",
    "Plain",
    "Register",
    "SessionLimits",
    "SessionRejected",
    "SessionStateMachine",
    "SessionTracker",
    "decode_envelope",
    "encode_envelope",
]

MAX_RESULTS_PER_SESSION = 4096
MAX_SESSIONS = 65_536  # live sessions; a Register beyond it ends the least recently used
MAX_RESULT_BYTES = 4 << 20  # cached result bytes per session
MAX_RESULT_BYTES_TOTAL = 512 << 20  # cached result bytes of all sessions together
RESULT_OVERHEAD = 64  # bytes charged per cached result on top of its encoding (dict entry)


class Register(msgspec.Struct, tag="reg", array_like=True, frozen=True):
    """Open a session; the result is the new client id (this entry's log index).

    ``token``: a secret chosen by the replica that proposed the registration (random
    bytes; empty for in-process sessions): every later command of the session must carry
    it, so a client cannot act in another client's session by naming its id."""

    token: bytes = b""
    # The proposer's session limits (0: keep those in force); see SessionLimits.
    max_sessions: int = 0
    max_results: int = 0
    max_result_bytes: int = 0
    max_result_bytes_total: int = 0


class Command(msgspec.Struct, tag="cmd", array_like=True, frozen=True):
    """A client command. ``seq`` starts at 1 and is unique per client; ``ack``: the client
    has received the results of every seq < ack."""

    client_id: int
    seq: int
    body: bytes
    ack: int = 0
    token: bytes = b""


class Expire(msgspec.Struct, tag="exp", array_like=True, frozen=True):
    """End these sessions (proposed by the leader; deterministic on every replica)."""

    client_ids: list[int]


class Plain(msgspec.Struct, tag="plain", array_like=True, frozen=True):
    """A command outside any session (internal/leader commands): applied every time."""

    body: bytes


Envelope = Register | Command | Expire | Plain


class SessionRejected(msgspec.Struct, tag="session_rejected", array_like=True, frozen=True):
    """Result of a command that was *not* applied: ``reason`` is ``"unknown_session"``
    (never registered or expired), ``"stale_seq"`` (below the session's ack floor),
    ``"result_evicted"`` (at or below a seq whose unacknowledged result a bound evicted: it
    may have been applied once, it is not applied again) or ``"bad_token"`` (the command
    does not carry the session's token)."""

    client_id: int
    seq: int
    reason: str


_enc = msgspec.msgpack.Encoder()
_env_dec = msgspec.msgpack.Decoder(Envelope)


def encode_envelope(env: Envelope) -> bytes:
    return _enc.encode(env)


def decode_envelope(data: bytes) -> Envelope:
    return _env_dec.decode(data)


class SessionLimits(msgspec.Struct, array_like=True, frozen=True):
    """Bounds of the session table. Part of the replicated state: set by each committed
    :class:`Register` that carries non-zero values (a node puts its configuration there),
    kept in snapshots, so every replica applies the same bounds."""

    max_sessions: int = MAX_SESSIONS
    max_results: int = MAX_RESULTS_PER_SESSION
    max_result_bytes: int = MAX_RESULT_BYTES
    max_result_bytes_total: int = MAX_RESULT_BYTES_TOTAL


class _Session(msgspec.Struct, array_like=True):
    floor: int  # results for seq < floor were dropped (client acknowledged them)
    results: dict[int, bytes]  # seq -> msgpack-encoded result, in apply order
    token: bytes = b""  # commands must carry it (empty: in-process session, not checked)
    last: int = 0  # log index of the session's last use: the LRU clock
    evicted: int = 0  # results of seq < evicted were evicted by a bound, unacknowledged


class _Table(msgspec.Struct, array_like=True):
    sessions: dict[int, _Session]
    limits: SessionLimits = SessionLimits()


def _cost(result: bytes) -> int:
    return len(result) + RESULT_OVERHEAD


_table_dec = msgspec.msgpack.Decoder(_Table)


class SessionStateMachine:
    """Wraps ``inner`` (a ``StateMachine``) whose entries are :data:`Envelope` payloads.

    Results of duplicates are decoded with ``inner.result_type`` if the inner machine
    defines one (else as plain msgpack), so a cached result equals the original for
    msgpack-native types. The keyword arguments are the initial :class:`SessionLimits`
    (until a committed :class:`Register` carries others; a restored snapshot carries its
    own).

    ``sessions`` is kept in least-recently-used order (oldest first), so ending the LRU
    session and choosing whose results a global bound evicts are O(1); both orders are
    rebuilt from ``_Session.last`` on restore.
    """

    def __init__(
        self,
        inner: StateMachine,
        max_results_per_session: int = MAX_RESULTS_PER_SESSION,
        *,
        max_sessions: int = MAX_SESSIONS,
        max_result_bytes: int = MAX_RESULT_BYTES,
        max_result_bytes_total: int = MAX_RESULT_BYTES_TOTAL,
    ) -> None:
        self.inner = inner
        self.limits = SessionLimits(
            max_sessions, max_results_per_session, max_result_bytes, max_result_bytes_total
        )
        self.sessions: dict[int, _Session] = {}
        # Sessions that hold cached results, in LRU order (a subset of ``sessions``).
        self._holding: dict[int, None] = {}
        self._bytes: dict[int, int] = {}  # client id -> charged bytes of its cached results
        self.result_bytes = 0  # all cached results (charged bytes)
        self.duplicates = 0  # commands answered from the cache (observability/tests)
        self.sessions_evicted = 0  # sessions ended by the live-session bound
        self.results_evicted = 0  # unacknowledged results dropped by a bound
        self.result_type: Any = getattr(inner, "result_type", Any)
        self._res_dec = msgspec.msgpack.Decoder(self.result_type)

    @property
    def max_results(self) -> int:
        return self.limits.max_results

    def apply(self, index: int, data: bytes) -> Any:
        env = _env_dec.decode(data)
        t = type(env)
        if t is Command:
            return self._command(index, env)
        if t is Plain:
            return self.inner.apply(index, env.body)
        if t is Register:
            self._set_limits(env)
            # Full: end the least-recently-used sessions now, in this apply (deterministic).
            while len(self.sessions) >= self.limits.max_sessions:
                self._drop(next(iter(self.sessions)))
                self.sessions_evicted += 1
            self.sessions[index] = _Session(0, {}, env.token, index)
            return index
        if t is Expire:
            for cid in env.client_ids:
                self._drop(cid)
            return None
        raise TypeError(f"unsupported envelope {env!r}")

    def _set_limits(self, reg: Register) -> None:
        old = msgspec.structs.astuple(self.limits)
        new = (reg.max_sessions, reg.max_results, reg.max_result_bytes, reg.max_result_bytes_total)
        if any(v > 0 for v in new):  # 0 (or nonsense): keep the limit in force
            self.limits = SessionLimits(*(v if v > 0 else o for v, o in zip(new, old)))

    def _drop(self, cid: int) -> None:
        if self.sessions.pop(cid, None) is not None:
            self._holding.pop(cid, None)
            self.result_bytes -= self._bytes.pop(cid, 0)

    def _touch(self, cid: int, s: _Session, index: int) -> None:
        """Make ``cid`` the most recently used session (at log index ``index``)."""
        s.last = index
        del self.sessions[cid]
        self.sessions[cid] = s
        self._holding.pop(cid, None)
        if s.results:
            self._holding[cid] = None

    def _forget(self, cid: int, s: _Session, seqs: list[int]) -> None:
        freed = 0
        for seq in seqs:
            freed += _cost(s.results.pop(seq))
        self._bytes[cid] -= freed
        self.result_bytes -= freed
        if not s.results:
            self._holding.pop(cid, None)
            del self._bytes[cid]

    def _evict(self, cid: int, s: _Session, seqs: list[int]) -> None:
        """Drop unacknowledged results: retries of any seq up to the highest evicted one get
        ``result_evicted`` (never a re-apply), so every result below it goes too."""
        s.evicted = max(s.evicted, max(seqs) + 1)
        below = [q for q in s.results if q < s.evicted]
        self.results_evicted += len(below)
        self._forget(cid, s, below)

    def _command(self, index: int, cmd: Command) -> Any:
        cid = cmd.client_id
        s = self.sessions.get(cid)
        if s is None:
            return SessionRejected(cid, cmd.seq, "unknown_session")
        if s.token and not hmac.compare_digest(s.token, cmd.token):
            # Before any state is touched: a foreign command must not move the floor.
            return SessionRejected(cid, cmd.seq, "bad_token")
        if cmd.seq < s.floor:
            return SessionRejected(cid, cmd.seq, "stale_seq")
        cached = s.results.get(cmd.seq)
        if cached is not None:
            self.duplicates += 1
            self._touch(cid, s, index)
            return self._res_dec.decode(cached)
        if cmd.seq < s.evicted:
            return SessionRejected(cid, cmd.seq, "result_evicted")
        self._touch(cid, s, index)
        result = self.inner.apply(index, cmd.body)
        enc = _enc.encode(result)
        s.results[cmd.seq] = enc
        self._holding[cid] = None
        self._bytes[cid] = self._bytes.get(cid, 0) + _cost(enc)
        self.result_bytes += _cost(enc)
        if cmd.ack > s.floor:
            s.floor = cmd.ack
            acked = [q for q in s.results if q < cmd.ack]
            if acked:
                self._forget(cid, s, acked)
        lim = self.limits
        if len(s.results) > lim.max_results or self._bytes.get(cid, 0) > lim.max_result_bytes:
            # A client that never acknowledges must not grow the table without bound: evict
            # its oldest results (apply order) until it fits both per-session bounds.
            n, b, out = len(s.results), self._bytes[cid], []
            for seq, r in s.results.items():
                if n <= lim.max_results and b <= lim.max_result_bytes:
                    break
                out.append(seq)
                n, b = n - 1, b - _cost(r)
            self._evict(cid, s, out)
        while self.result_bytes > lim.max_result_bytes_total and self._holding:
            # All sessions together: evict every cached result of the least recently used
            # session holding any (O(1) to find; each result is evicted at most once).
            victim = next(iter(self._holding))
            vs = self.sessions[victim]
            self._evict(victim, vs, list(vs.results))
        return result

    def session_ids(self) -> list[int]:
        return list(self.sessions)

    def session_token(self, client_id: int) -> bytes | None:
        """The applied token of a session (None if unknown here)."""
        s = self.sessions.get(client_id)
        return None if s is None else s.token

    # ---------------------------------------------------------------- snapshots

    def snapshot_chunks(self) -> Iterator[bytes]:
        """Session table first (small: encoded now), then the inner machine's image."""
        table = pack_chunk(_enc.encode(_Table(self.sessions, self.limits)))
        rest = snapshot_chunks_of(self.inner)

        def gen() -> Iterator[bytes]:
            yield table
            yield from rest

        return gen()

    def snapshot(self) -> bytes:
        return b"".join(self.snapshot_chunks())

    def query(self, data: bytes) -> Any:
        """Read-only requests go to the inner machine (sessions have no queries)."""
        return self.inner.query(data)

    def restore(self, data: bytes) -> None:
        mv = memoryview(data)
        if len(mv) < 8:
            raise SnapshotCorruptionError("session snapshot: missing session table")
        length, want = struct.unpack_from("<II", mv, 0)
        table = mv[8 : 8 + length]
        if len(table) != length or crc32c.crc32c(table) != want:
            raise SnapshotCorruptionError("session snapshot: session table fails its CRC")
        t = _table_dec.decode(table)
        # LRU order is the order of last use (log indices: unique per session).
        sessions = dict(sorted(t.sessions.items(), key=lambda kv: kv[1].last))
        self.inner.restore(mv[8 + length :])  # a view: the image is not copied again
        self.sessions, self.limits = sessions, t.limits
        self._holding = {cid: None for cid, s in sessions.items() if s.results}
        self._bytes = {
            cid: sum(_cost(r) for r in s.results.values())
            for cid, s in sessions.items()
            if s.results
        }
        self.result_bytes = sum(self._bytes.values())


class SessionTracker:
    """Leader-local soft state: when each session was last active, to decide which sessions
    to expire (by proposing :class:`Expire`). Never consulted by ``apply``.

    A new leader calls :meth:`reset` with the current session ids: every session then gets
    a full ``ttl`` from that moment, because the old leader's observations are lost. At most
    ``max_entries`` sessions are tracked (the least recently touched are forgotten: the
    session table ends those itself when it is full), so registrations cannot grow it.
    """

    def __init__(self, ttl_s: float, max_entries: int = MAX_SESSIONS) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._last: dict[int, float] = {}  # in touch order (oldest first)

    def reset(self, session_ids: list[int], now: float) -> None:
        self._last = {cid: now for cid in session_ids[-self.max_entries :]}

    def touch(self, client_id: int, now: float) -> None:
        self._last.pop(client_id, None)
        self._last[client_id] = now
        while len(self._last) > self.max_entries:
            del self._last[next(iter(self._last))]

    def forget(self, client_ids: list[int]) -> None:
        for cid in client_ids:
            self._last.pop(cid, None)

    def idle(self, now: float, limit: int = 1000) -> list[int]:
        """Sessions idle for longer than the TTL (at most ``limit``, oldest first)."""
        out = []
        for cid, t in self._last.items():
            if now - t <= self.ttl_s or len(out) >= limit:
                break
            out.append(cid)
        return out
