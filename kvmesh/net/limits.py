"""Deadlines and connection caps shared by every kvmesh server."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

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


class Slot:
    """A connection's place in a :class:`ConnectionLimiter` (returned by ``try_acquire``)."""

    __slots__ = ("authed", "evicted", "on_evict", "released")

    def __init__(self, on_evict: Callable[[], None] | None = None) -> None:
        self.authed = False
        self.released = False
        self.evicted = False
        self.on_evict = on_evict


class ConnectionLimiter:
    """Caps on open connections in total and on those not yet authenticated.

    Servers take a slot right after ``accept`` and close the connection at once when none is
    left, so a flood of connections costs a bounded number of sockets and workers. Thread-safe
    and non-blocking, so asyncio servers use it as well.

    A slot taken with ``on_evict`` may be evicted: when the unauthenticated cap is full, a new
    connection takes the place of the *oldest* evictable unauthenticated one (whose
    ``on_evict`` is called to close it) instead of being refused. Otherwise a peer holding
    ``max_unauthenticated`` silent connections, renewed at each handshake deadline, would
    lock every legitimate client out at no cost; with eviction it has to open connections
    faster than a legitimate handshake completes.
    """

    def __init__(self, max_total: int, max_unauthenticated: int) -> None:
        if max_total < 1 or max_unauthenticated < 1:
            raise ValueError("connection limits must be >= 1")
        self.max_total = max_total
        self.max_unauthenticated = min(max_unauthenticated, max_total)
        self._lock = threading.Lock()
        self._total = 0
        self._unauth = 0
        self._evictable: dict[Slot, None] = {}  # unauthenticated slots with on_evict, oldest first
        self.refused = 0  # connections turned away (for stats and tests)
        self.evicted = 0  # unauthenticated connections closed to make room

    def try_acquire(self, on_evict: Callable[[], None] | None = None) -> Slot | None:
        """A slot for a new (unauthenticated) connection, or None when a cap is reached.
        ``on_evict``: how to close this connection should a newer one need its place
        while it is still unauthenticated (called at most once, from ``try_acquire``)."""
        victim = None
        with self._lock:
            if self._total >= self.max_total:
                self.refused += 1
                return None
            if self._unauth >= self.max_unauthenticated:
                if not self._evictable:
                    self.refused += 1
                    return None
                victim = next(iter(self._evictable))
                self._release_locked(victim)
                victim.evicted = True
                self.evicted += 1
            self._total += 1
            self._unauth += 1
            slot = Slot(on_evict)
            if on_evict is not None:
                self._evictable[slot] = None
        if victim is not None and victim.on_evict is not None:
            victim.on_evict()
        return slot

    def authenticated(self, slot: Slot) -> bool:
        """The connection passed its handshake: it no longer counts as unauthenticated.
        False if the slot was released or evicted meanwhile (close the connection)."""
        with self._lock:
            if slot.released:
                return False
            if not slot.authed:
                slot.authed = True
                self._unauth -= 1
                self._evictable.pop(slot, None)
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
            self._evictable.pop(slot, None)

    @property
    def total(self) -> int:
        return self._total

    @property
    def unauthenticated(self) -> int:
        return self._unauth

    def __repr__(self) -> str:
        return (
            f"ConnectionLimiter({self._total}/{self.max_total} open, "
            f"{self._unauth}/{self.max_unauthenticated} unauthenticated)"
        )
