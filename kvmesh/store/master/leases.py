"""Leader soft state: read leases, access order for eviction, node heartbeats.

None of this is replicated: it lives in the current leader only, is fed an explicit ``now``
(the service's clock) and is rebuilt from scratch by a new leader. That is safe because a
new leader starts pessimistic: :class:`LeaseTable` treats every key an earlier leader may
have leased as leased for one lease period from its start (leases granted by an old leader
end within that period), and :class:`HeartbeatTable.reset` gives every node a full TTL.
Which keys those are is :class:`TermStart`'s to say (docs/store.md, "The new leader's
grace period").

The service consults these tables before proposing anything that frees memory (Remove,
Upsert of an existing key, Evict, Release): ``apply`` never sees a lease.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import repeat
from typing import Any

__all__ = [
    "DEFAULT_LEASE_TTL",
    "DEFAULT_NODE_TTL",
    "AccessStamps",
    "AccessStats",
    "HeartbeatTable",
    "LeaseTable",
    "TermStart",
]

DEFAULT_LEASE_TTL = 5.0
"""Seconds a read lease lasts (Mooncake's default_kv_lease_ttl is 5000 ms)."""

DEFAULT_NODE_TTL = 10.0
"""Seconds without a heartbeat after which the leader expires a storage node."""


class TermStart:
    """Which objects no earlier leader can have leased: the exceptions to a new leader's
    grace period.

    ``first_index``: an index from which on every log entry is this leader's own: its last
    log index when it learned it leads, plus one (every entry an earlier leader committed,
    and so every entry it applied and served reads from, is in the log by then, below it).
    An earlier leader leased only COMPLETE objects of the state it had applied, a prefix of
    the entries below ``first_index``; so an object that was not COMPLETE after all of them
    -- allocated by an entry of this term (version >= ``first_index``), PROCESSING when the
    last of them was applied (its PutEnd is this term's), or created after that -- never had
    an earlier leader's lease. Its memory cannot be under one either: it was free (freed
    memory is never leased: leased bytes are held, not freed) or, for an in-place upsert, the
    old version's, which the upsert's own leader checked, blocking new leases until it
    applied. :meth:`observe` records the PROCESSING puts at that point."""

    def __init__(self, first_index: int) -> None:
        self.first_index = first_index
        self._pending: dict[str, int] | None = None  # PROCESSING key -> version then

    def observe(self, next_index: int, processing: Mapping[str, int]) -> None:
        """Before entry ``next_index`` is applied (or with the applied index + 1 at any
        time): once every entry below ``first_index`` is applied, remember what was
        PROCESSING then (the state is the same until an entry of this term applies)."""
        if self._pending is None and next_index >= self.first_index:
            self._pending = dict(processing)

    @property
    def settled(self) -> bool:
        """Whether every entry below ``first_index`` has been applied (:meth:`observe`)."""
        return self._pending is not None

    def fresh(self, key: str, version: int) -> bool:
        """Whether the object ``version`` of ``key`` (0: no object) can have no earlier
        leader's lease. Nothing is fresh before :attr:`settled`: an entry of an earlier
        term still to be applied may complete (or create) the key."""
        p = self._pending
        if p is None:
            return False
        return not version or version >= self.first_index or p.get(key) == version


class LeaseTable:
    """Read leases per key, plus removal blocks.

    ``LeaseTable(start=now, grace=ttl, fresh=...)`` on becoming leader: until ``start +
    grace`` every key counts as leased, except those ``fresh(key)`` says no earlier leader
    can have leased (:class:`TermStart`; without ``fresh``, none). ``grant`` records ``now +
    ttl`` (keeping the later of an existing expiry); a key under :meth:`block` (a removal in
    flight) gets no lease.
    """

    def __init__(
        self,
        start: float = float("-inf"),
        grace: float = 0.0,
        fresh: Callable[[str], bool] | None = None,
    ) -> None:
        self.blanket_until = start + grace
        self._fresh = fresh
        self._until: dict[str, float] = {}
        # Expiry queue, one entry per grant: (expiry, keys granted it), in expiry order.
        self._order: deque[tuple[float, list[str]]] = deque()
        self._queued = 0  # keys in the queue
        self._blocked: dict[str, int] = {}
        self._latest = float("-inf")  # the latest expiry ever granted

    def grant(self, keys: Iterable[str], now: float, ttl: float = DEFAULT_LEASE_TTL) -> list[float]:
        """Lease ``keys`` until ``now + ttl``; per key the expiry, or 0.0 if blocked."""
        until = now + ttl
        u = self._until
        if self._queued > 2 * len(u) + 4096:
            self.purge(now)  # keep the expiry queue proportional to the live leases
        ks = keys if type(keys) is list else list(keys)
        if until >= self._latest and not self._blocked:
            # No lease ends later and no key is blocked (the usual case): every key gets
            # `until`, set with C-level passes instead of a Python step per key.
            self._latest = until
            if len(ks) == 1:
                u[ks[0]] = until
            else:
                u.update(dict.fromkeys(ks, until))
            self._queue(until, ks)
            return [until] * len(ks)
        out = []
        got = []
        for k in ks:
            if k in self._blocked:
                out.append(0.0)
                continue
            if u.get(k, float("-inf")) < until:
                u[k] = until
                got.append(k)
            out.append(until)
        if got:
            self._queue(until, got)
        return out

    def _queue(self, until: float, keys: list[str]) -> None:
        self._order.append((until, keys))
        self._latest = max(self._latest, until)
        self._queued += len(keys)

    def leased(self, key: str, now: float) -> bool:
        """True if a reader may still be copying ``key`` at ``now``."""
        return self._until.get(key, float("-inf")) > now or self.in_grace(key, now)

    def in_grace(self, key: str, now: float) -> bool:
        """Whether ``key`` counts as leased by the grace period (an earlier leader may
        have leased it)."""
        return now < self.blanket_until and (self._fresh is None or not self._fresh(key))

    def expiry(self, key: str) -> float:
        """When ``key``'s lease ends (``-inf`` if none; the grace period counts)."""
        own = self._until.get(key, float("-inf"))
        if self._fresh is not None and self._fresh(key):
            return own
        return max(self.blanket_until, own)

    def leased_keys(self, keys: Iterable[str], now: float) -> list[str]:
        return [k for k in keys if self.leased(k, now)]

    def all_leased(self, now: float) -> list[str]:
        """Keys with a live lease of their own (the blanket period is not expanded)."""
        return [k for k, t in self._until.items() if t > now]

    def block(self, keys: Iterable[str]) -> None:
        """A removal of ``keys`` is in flight: refuse new leases until :meth:`unblock`
        (counted, so overlapping removals nest)."""
        b = self._blocked
        for k in keys:
            b[k] = b.get(k, 0) + 1

    def unblock(self, keys: Iterable[str]) -> None:
        b = self._blocked
        for k in keys:
            n = b.get(k, 0) - 1
            if n <= 0:
                b.pop(k, None)
            else:
                b[k] = n

    def blocked(self, key: str) -> bool:
        return key in self._blocked

    def purge(self, now: float, limit: int = 100_000) -> int:
        """Forget up to ``limit`` expired leases (memory only); returns how many."""
        n = 0
        q, u = self._order, self._until
        while q and n < limit and q[0][0] <= now:
            t, keys = q.popleft()
            self._queued -= len(keys)
            for k in keys:
                if u.get(k) == t:
                    del u[k]
                    n += 1
        return n

    def __len__(self) -> int:
        return len(self._until)


class AccessStats:
    """Approximate LRU order of keys as the leader observed accesses (reads, puts).

    A plain insertion-ordered dict: :meth:`touch` moves a key to the young end. A new
    leader :meth:`reset`s it with the state machine's keys (all equally old, in table order).
    Keys the table no longer has are skipped and dropped lazily by :meth:`oldest`.
    """

    def __init__(self) -> None:
        self._order: dict[str, None] = {}

    def reset(self, keys: Iterable[str]) -> None:
        self._order = dict.fromkeys(keys)

    def touch(self, keys: Iterable[str]) -> None:
        o = self._order
        if type(keys) is list and len(keys) == 1:  # a single get
            k = keys[0]
            o.pop(k, None)
            o[k] = None
            return
        young = dict.fromkeys(keys) if type(keys) is list else None
        if young is not None and len(young) == len(keys):
            # a batch of distinct keys (the dict tells, no set built): the same moves as
            # the loop below, at C speed
            if not keys:
                return
            if keys[0] not in o:
                n = len(o)
                o.update(young)
                if len(o) - n == len(young):
                    # all new (a PutEnd of new keys, the common case): appended in order,
                    # which is where the moves put them; one pass over the big dict, not two
                    return
            # (a read's keys are known: straight to the moves, no trial pass first)
            deque(map(o.pop, keys, repeat(None)), maxlen=0)
            o.update(young)
            return
        for k in keys:
            o.pop(k, None)
            o[k] = None

    def forget(self, keys: Iterable[str]) -> None:
        o = self._order
        for k in keys:
            o.pop(k, None)

    def oldest(self, skip: Any = None) -> Iterator[str]:
        """Keys from least to most recently used (a snapshot: safe to mutate while iterating).
        ``skip`` (a row mask, :meth:`AccessStamps.oldest`): a hint this order cannot use."""
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: str) -> bool:
        return key in self._order


class AccessStamps:
    """The leader's access order as the object table's stamp column (``Table.stamp``, see
    table.py): the :class:`AccessStats` interface without a second dict of every key.
    ``sm``: the state machine, whose table is looked up on each call (a restore replaces
    it, and a restored table starts with every object equally old)."""

    def __init__(self, sm: Any) -> None:
        self._sm = sm

    def reset(self, keys: Iterable[str] = ()) -> None:
        self._sm.objects.reset_stamps()

    def touch(self, keys: Iterable[str]) -> None:
        self._sm.objects.touch(keys)

    def forget(self, keys: Iterable[str]) -> None:
        """Nothing to do: a freed row is skipped, a reused one starts as the oldest."""

    def oldest(self, skip: Any = None) -> Iterator[str]:
        """Keys from the least recently touched; ``skip``: a mask of table rows to leave
        out (rows the caller would pass over anyway, ``Table.oldest_rows``)."""
        t = self._sm.objects
        names = t.names
        for r in t.oldest_rows(skip=skip):
            k = names[r]
            if k is not None:
                yield k

    def __len__(self) -> int:
        return len(self._sm.objects)

    def __contains__(self, key: str) -> bool:
        return key in self._sm.objects


class HeartbeatTable:
    """Last heartbeat per storage node; :meth:`expired` lists the nodes to expire."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def reset(self, node_ids: Iterable[str], now: float) -> None:
        """New leader: every known node gets a full TTL from ``now``."""
        self._last = dict.fromkeys(node_ids, now)

    def beat(self, node_id: str, now: float) -> None:
        if self._last.get(node_id, float("-inf")) < now:
            self._last[node_id] = now

    def forget(self, node_ids: Iterable[str]) -> None:
        for n in node_ids:
            self._last.pop(n, None)

    def last(self, node_id: str) -> float | None:
        return self._last.get(node_id)

    def expired(self, now: float, ttl: float = DEFAULT_NODE_TTL) -> list[str]:
        """Nodes silent for more than ``ttl`` (sorted, so proposals are reproducible)."""
        return sorted(n for n, t in self._last.items() if now - t > ttl)

    def __len__(self) -> int:
        return len(self._last)
