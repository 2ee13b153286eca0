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

Sessions end only through a committed :class:`Expire` entry that the leader proposes
(:class:`SessionTracker` helps it choose); ``apply`` never reads a clock. A command from an
unknown (expired or never registered) session is not applied; it returns
:class:`SessionRejected`, which clients must surface as "outcome unknown" for that command,
never retry blindly.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Iterator
from typing import Any, Union

import crc32c
import msgspec

from .snapfile import SnapshotCorruptionError, pack_chunk
from .types import StateMachine, snapshot_chunks_of

__all__ = [
    "MAX_RESULTS_PER_SESSION",
    "Command",
    "Envelope",
    "Expire",
    "Plain",
    "Register",
    "SessionRejected",
    "SessionStateMachine",
    "SessionTracker",
    "decode_envelope",
    "encode_envelope",
]

MAX_RESULTS_PER_SESSION = 4096


class Register(msgspec.Struct, tag="reg", array_like=True, frozen=True):
    """Open a session; the result is the new client id (this entry's log index).

    ``token``: a secret chosen by the replica that proposed the registration (random
    bytes; empty for in-process sessions): every later command of the session must carry
    it, so a client cannot act in another client's session by naming its id."""

    token: bytes = b""


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


Envelope = Union[Register, Command, Expire, Plain]


class SessionRejected(msgspec.Struct, tag="session_rejected", array_like=True, frozen=True):
    """Result of a command that was *not* applied: ``reason`` is ``"unknown_session"``
    (never registered or expired), ``"stale_seq"`` (below the session's ack floor) or
    ``"bad_token"`` (the command does not carry the session's token)."""

    client_id: int
    seq: int
    reason: str


_enc = msgspec.msgpack.Encoder()
_env_dec = msgspec.msgpack.Decoder(Envelope)


def encode_envelope(env: Envelope) -> bytes:
    return _enc.encode(env)


def decode_envelope(data: bytes) -> Envelope:
    return _env_dec.decode(data)


class _Session(msgspec.Struct, array_like=True):
    floor: int  # results for seq < floor were dropped (client acknowledged them)
    results: dict[int, bytes]  # seq -> msgpack-encoded result
    token: bytes = b""  # commands must carry it (empty: in-process session, not checked)


class _Table(msgspec.Struct, array_like=True):
    sessions: dict[int, _Session]


_table_dec = msgspec.msgpack.Decoder(_Table)


class SessionStateMachine:
    """Wraps ``inner`` (a ``StateMachine``) whose entries are :data:`Envelope` payloads.

    Results of duplicates are decoded with ``inner.result_type`` if the inner machine
    defines one (else as plain msgpack), so a cached result equals the original for
    msgpack-native types.
    """

    def __init__(self, inner: StateMachine, max_results_per_session: int = MAX_RESULTS_PER_SESSION) -> None:
        self.inner = inner
        self.max_results = max_results_per_session
        self.sessions: dict[int, _Session] = {}
        self.duplicates = 0  # commands answered from the cache (observability/tests)
        self.result_type: Any = getattr(inner, "result_type", Any)
        self._res_dec = msgspec.msgpack.Decoder(self.result_type)

    def apply(self, index: int, data: bytes) -> Any:
        env = _env_dec.decode(data)
        t = type(env)
        if t is Command:
            return self._command(index, env)
        if t is Plain:
            return self.inner.apply(index, env.body)
        if t is Register:
            self.sessions[index] = _Session(0, {}, env.token)
            return index
        if t is Expire:
            for cid in env.client_ids:
                self.sessions.pop(cid, None)
            return None
        raise TypeError(f"unsupported envelope {env!r}")

    def _command(self, index: int, cmd: Command) -> Any:
        s = self.sessions.get(cmd.client_id)
        if s is None:
            return SessionRejected(cmd.client_id, cmd.seq, "unknown_session")
        if s.token and not hmac.compare_digest(s.token, cmd.token):
            # Before any state is touched: a foreign command must not move the floor.
            return SessionRejected(cmd.client_id, cmd.seq, "bad_token")
        if cmd.seq < s.floor:
            return SessionRejected(cmd.client_id, cmd.seq, "stale_seq")
        cached = s.results.get(cmd.seq)
        if cached is not None:
            self.duplicates += 1
            return self._res_dec.decode(cached)
        result = self.inner.apply(index, cmd.body)
        s.results[cmd.seq] = _enc.encode(result)
        if cmd.ack > s.floor:
            s.floor = cmd.ack
            for seq in [q for q in s.results if q < cmd.ack]:
                del s.results[seq]
        if len(s.results) > self.max_results:
            # A client that never acknowledges must not grow the table without bound: forget
            # its oldest results (retries of those now get "stale_seq", never a re-apply).
            excess = sorted(s.results)[: len(s.results) - self.max_results]
            for seq in excess:
                del s.results[seq]
            s.floor = max(s.floor, excess[-1] + 1)
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
        table = pack_chunk(_enc.encode(_Table(self.sessions)))
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
        self.sessions = _table_dec.decode(table).sessions
        self.inner.restore(bytes(mv[8 + length :]))


class SessionTracker:
    """Leader-local soft state: when each session was last active, to decide which sessions
    to expire (by proposing :class:`Expire`). Never consulted by ``apply``.

    A new leader calls :meth:`reset` with the current session ids: every session then gets
    a full ``ttl`` from that moment, because the old leader's observations are lost.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._last: dict[int, float] = {}

    def reset(self, session_ids: list[int], now: float) -> None:
        self._last = {cid: now for cid in session_ids}

    def touch(self, client_id: int, now: float) -> None:
        self._last[client_id] = now

    def forget(self, client_ids: list[int]) -> None:
        for cid in client_ids:
            self._last.pop(cid, None)

    def idle(self, now: float, limit: int = 1000) -> list[int]:
        """Sessions idle for longer than the TTL (at most ``limit``, oldest first)."""
        out = [cid for cid, t in self._last.items() if now - t > self.ttl_s]
        out.sort(key=lambda c: self._last[c])
        return out[:limit]
