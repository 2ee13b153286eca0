"""Deadlines and connection caps shared by every kvmesh server."""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import DeadlineExceeded


class Deadline:
    """One absolute point in time; every blocking step of an operation takes what is left."""

    __slots__ = ("_clock", "at", "seconds")

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.seconds = float(seconds)
        self.at = clock() + self.seconds

    def remaining(self) -> float:
        """Seconds left (0.0 once expired, never negative)."""
        return max(0.0, self.at - self._clock())

    def expired(self) -> bool:
        return self._clock() >= self.at

    def check(self, what: str = "operation") -> float:
        """Seconds left; raises :class:`DeadlineExceeded` when none are."""
        left = self.at - self._clock()
        if left <= 0:
            raise DeadlineExceeded(f"{what} passed its {self.seconds:g} s deadline")
        return left

    def __repr__(self) -> str:
        return f"Deadline({self.seconds:g} s, {self.remaining():.3f} s left)"


def source_of(peername: object) -> str:
    """The source a connection counts against for per-source limits: the peer's IPv4
    address, or the /64 prefix of its IPv6 address (one host or site usually holds a whole
    /64, so per-address caps would mean nothing there); an IPv4-mapped IPv6 address counts
    as its IPv4 address. ``peername`` is what ``getpeername()`` (or asyncio's
    ``get_extra_info("peername")``) returns; anything else (a Unix socket, None) is ``""``."""
    if not isinstance(peername, tuple) or not peername or not isinstance(peername[0], str):
        return ""
    host = peername[0]
    if ":" not in host:
        return host
    try:
        ip = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((ip, 64), strict=False).network_address) + "/64"


class Slot:
    """A connection's place in a :class:`ConnectionLimiter` (returned by ``try_acquire``)."""

    __slots__ = ("authed", "born", "evicted", "handshake", "on_evict", "released", "source")

    def __init__(
        self, on_evict: Callable[[], None] | None = None, source: str = "", born: float = 0.0
    ) -> None:
        self.born = born  # when it was taken (the limiter's clock)
        self.authed = False
        self.released = False
        self.evicted = False
        self.on_evict = on_evict
        self.source = source
        # The handshake the accept path already began (a greeting listener sent its
        # Challenge while the connection waited; kvmesh.net.listener), else None.
        self.handshake: Any = None


MIN_HANDSHAKE_AGE_S = 0.25
"""What servers pass as ``min_handshake_age_s``: a handshake takes a round trip and a few
HMACs (milliseconds); a quarter second covers a slow path and still evicts a stalled one
long before its deadline (5 s)."""


class ConnectionLimiter:
    """Caps on open connections in total, on those not yet authenticated, and on those not
    yet authenticated per source address (:func:`source_of`).

    Servers take a slot right after ``accept`` and close the connection at once when none is
    left, so a flood of connections costs a bounded number of sockets and workers. Thread-safe
    and non-blocking, so asyncio servers use it as well.

    A slot taken with ``on_evict`` may be evicted while it is unauthenticated, so that a
    newcomer is admitted instead of refused (``on_evict`` closes the victim):

    * its source already holds ``max_unauthenticated_per_source`` unauthenticated slots: the
      source's own oldest one goes (a flood from one address only churns its own slots);
    * a cap in total or on unauthenticated slots is reached: the oldest evictable slot of the
      source holding the most unauthenticated slots goes.

    Without eviction a peer holding ``max_unauthenticated`` silent connections, renewed at
    each handshake deadline, would lock every legitimate client out at no cost; with it, it
    has to open connections faster than a legitimate handshake completes, and with the
    per-source rule even that only delays peers of its own address: a peer on another address
    is never the victim while the flooding source holds more handshakes than it.

    Eviction alone lets a connect flood buy a handshake (a transport, a task, a Challenge) per
    connection, far more than an asyncio server can build (docs/net.md, "Connect floods"), so
    a slot younger than ``min_handshake_age_s`` is never evicted: a newcomer that could only
    take such a slot's place is refused (``refused_young``). A source at its cap therefore
    gets at most ``max_unauthenticated_per_source / min_handshake_age_s`` handshakes a
    second, and every admitted handshake has at least that long to finish, whoever floods.
    """

    def __init__(
        self,
        max_total: int,
        max_unauthenticated: int,
        max_unauthenticated_per_source: int | None = None,
        *,
        min_handshake_age_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_total < 1 or max_unauthenticated < 1:
            raise ValueError("connection limits must be >= 1")
        self.max_total = max_total
        self.max_unauthenticated = min(max_unauthenticated, max_total)
        per_source = max_unauthenticated_per_source
        if per_source is None:
            per_source = max(1, self.max_unauthenticated // 2)
        if per_source < 1:
            raise ValueError("connection limits must be >= 1")
        self.max_unauthenticated_per_source = min(per_source, self.max_unauthenticated)
        if min_handshake_age_s < 0:
            raise ValueError("min_handshake_age_s must be >= 0")
        self.min_handshake_age_s = min_handshake_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._total = 0
        self._unauth = 0
        # source -> its unauthenticated slots (evictable or not), oldest first
        self._sources: dict[str, dict[Slot, None]] = {}
        self.refused = 0  # connections turned away (for stats and tests)
        self.refused_young = 0  # of those, because every victim was too young
        self.evicted = 0  # unauthenticated connections closed to make room

    def try_acquire(
        self, on_evict: Callable[[], None] | None = None, source: str = ""
    ) -> Slot | None:
        """A slot for a new (unauthenticated) connection from ``source`` (:func:`source_of`
        of its peer address; ``""``, unknown, has no per-source cap), or None when a cap is
        reached and nothing can be evicted.
        ``on_evict``: how to close this connection should a newer one need its place while
        it is still unauthenticated (called at most once, from ``try_acquire``)."""
        with self._lock:
            victim = None
            mine = self._sources.get(source) if source else None
            now = self._clock()
            born = now - self.min_handshake_age_s  # a victim must be this old
            if mine is not None and len(mine) >= self.max_unauthenticated_per_source:
                victim = self._oldest_evictable(mine)
                if victim is None or victim.born > born:
                    self.refused += 1
                    self.refused_young += victim is not None
                    return None
            elif self._total >= self.max_total or self._unauth >= self.max_unauthenticated:
                victim = self._heaviest_victim(born)
                if victim is None:
                    self.refused += 1
                    return None
            if victim is not None:
                self._release_locked(victim)
                victim.evicted = True
                self.evicted += 1
            self._total += 1
            self._unauth += 1
            slot = Slot(on_evict, source, now)
            self._sources.setdefault(source, {})[slot] = None
        if victim is not None and victim.on_evict is not None:
            victim.on_evict()
        return slot

    @staticmethod
    def _oldest_evictable(slots: dict[Slot, None]) -> Slot | None:
        for s in slots:
            if s.on_evict is not None:
                return s
        return None

    def _heaviest_victim(self, born: float) -> Slot | None:
        # Only at a cap: one pass over the sources with handshakes in progress.
        best = None
        best_n = 0
        for slots in self._sources.values():
            if len(slots) > best_n:
                s = self._oldest_evictable(slots)
                if s is not None and s.born <= born:
                    best, best_n = s, len(slots)
        if best is None and self.min_handshake_age_s:
            self.refused_young += 1
        return best

    def authenticated(self, slot: Slot) -> bool:
        """The connection passed its handshake: it no longer counts as unauthenticated.
        False if the slot was released or evicted meanwhile (close the connection)."""
        with self._lock:
            if slot.released:
                return False
            if not slot.authed:
                slot.authed = True
                self._unauth -= 1
                self._forget(slot)
            return True

    def release(self, slot: Slot) -> None:
        """The connection closed (idempotent)."""
        with self._lock:
            self._release_locked(slot)

    def _release_locked(self, slot: Slot) -> None:
        if slot.released:
            return
        slot.released = True
        self._total -= 1
        if not slot.authed:
            self._unauth -= 1
            self._forget(slot)

    def _forget(self, slot: Slot) -> None:
        mine = self._sources.get(slot.source)
        if mine is not None:
            mine.pop(slot, None)
            if not mine:
                del self._sources[slot.source]

    def unauthenticated_from(self, source: str) -> int:
        """Unauthenticated connections ``source`` holds now."""
        with self._lock:
            return len(self._sources.get(source, ()))

    @property
    def total(self) -> int:
        return self._total

    @property
    def unauthenticated(self) -> int:
        return self._unauth

    def __repr__(self) -> str:
        return (
            f"ConnectionLimiter({self._total}/{self.max_total} open, "
            f"{self._unauth}/{self.max_unauthenticated} unauthenticated, "
            f"{len(self._sources)} sources)"
        )
