"""The client's view of its reservations: bytes the master holds for this client (a held
tag, docs/store-master.md "Reservations") in which the client places the objects of a put
itself, so that a put is one round trip (write, then one ``PutCommit``) instead of two.

One reservation per placement config (``ReplicateConfig``: the master placed its extents
by it). Its free extents are kept in the master's normal form (sorted, coalesced), so a
batch laid out inside one of them here is inside one there; :meth:`Reservation.take`
carves a batch's bytes out under the lock (threads never get the same bytes), and the
extents of keys that were not published go back with :meth:`Reservation.give`.
The reservation is used only before its deadline: ``0.8 x hold_ms`` from before the
request that granted or last renewed it was sent (the master keeps it ``hold_ms`` after
applying that request).
"""

from __future__ import annotations

import threading
import time

from ..types import ReplicateConfig

__all__ = ["MAX_RESERVE", "Reservation", "Reservations"]

MAX_RESERVE = 128 << 20
"""The largest batch (bytes) put through a reservation: larger ones take the two-round-trip
put (their round trips are small beside their bytes), so a client keeps at most this much
reserved per config."""


def _coalesce(ext: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for e in sorted(ext):
        if out and out[-1][0] == e[0] and out[-1][1] + out[-1][2] == e[1]:
            out[-1] = (e[0], out[-1][1], out[-1][2] + e[2])
        else:
            out.append(e)
    return out


class Reservation:
    """One reservation: its tag, free extents ``(sid, offset, length)``, the segments they
    are in (sid -> ``(name, node_id, endpoint)``), its deadline (monotonic) and the largest
    object the master takes in a commit (``limit``)."""

    __slots__ = ("align", "busy", "deadline", "ext", "hold", "limit", "segs", "tag")

    def __init__(self, tag: int, limit: int, align: int) -> None:
        self.tag = tag
        # puts carved from it and not yet answered: while any is, the reservation is never
        # released (the master would give their bytes to the next put, under their writes)
        self.busy = 0
        self.limit = limit
        self.align = align
        self.ext: list[tuple[int, int, int]] = []
        self.segs: dict[int, tuple[str, str, str]] = {}
        self.deadline = 0.0
        self.hold = 0.0

    def free_bytes(self) -> int:
        return sum(e[2] for e in self.ext)

    def take(self, n: int) -> tuple[int, int] | None:
        """``(sid, offset)`` of ``n`` bytes carved from the smallest extent that holds them."""
        best = -1
        for j, (_, _, ln) in enumerate(self.ext):
            if ln >= n and (best < 0 or ln < self.ext[best][2]):
                best = j
        if best < 0:
            return None
        sid, off, ln = self.ext[best]
        if ln == n:
            del self.ext[best]
        else:
            self.ext[best] = (sid, off + n, ln - n)
        return sid, off

    def give(self, sid: int, off: int, n: int) -> None:
        self.ext = _coalesce([*self.ext, (sid, off, n)])

    def grant(self, added: list[int], seg: tuple[str, str, str] | None, hold_ms: int, t0: float):
        """A commit's reply: the extent it added, and the renewed hold from ``t0``."""
        if len(added) == 3 and seg is not None and added[2] > 0:
            sid, off, n = added
            self.segs[sid] = tuple(seg)  # type: ignore[assignment]
            self.give(sid, off, n)
        self.hold = hold_ms / 1000.0
        self.deadline = t0 + 0.8 * self.hold


class Reservations:
    """This client's reservations by config, and whether the master takes commits."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_config: dict[ReplicateConfig, Reservation] = {}
        self.supported = True
        self.quiet_until = 0.0  # after a refused reservation: the two-round-trip put until

    @staticmethod
    def eligible(config: ReplicateConfig) -> bool:
        """Configs whose placement a reservation can stand for: one copy, placed by the
        strategy (not a random draw per key, not a named segment)."""
        return (
            config.replica_num == 1
            and config.strategy != "random"
            and config.preferred_segment is None
        )

    def usable(self, config: ReplicateConfig, margin: float) -> Reservation | None:
        """The reservation for ``config`` if a write started now can end before its
        deadline (``margin`` seconds left, at most a fifth of its hold)."""
        r = self.by_config.get(config)
        if r is not None and r.deadline - time.monotonic() <= min(margin, 0.2 * r.hold):
            return None
        return r
