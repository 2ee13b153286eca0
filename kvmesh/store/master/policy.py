"""The leader's rules for proposing commands that free memory (pure; the service calls these).

``apply`` never sees leases, so whoever proposes ``Remove``, ``Upsert``, ``Evict`` or
``Release`` must apply the lease rules first. They live here, once, for the service, the
simulator and the transcript tests:

* :func:`plan_remove`: leased keys answer ``ObjectHasLease`` without a log entry, unless
  ``force``: then they are removed with ``hold=True`` (invisible at once, bytes kept until
  the leases end) and :class:`HoldTracker` remembers when the hold may be released.
* :func:`plan_remove_prefix`: one round of a remove by prefix over the keys the leader's
  bounded scan found (:meth:`~.state.StoreStateMachine.prefix_candidates`), with the rules of
  :func:`plan_remove`: leased keys are skipped and counted, or with ``force`` removed under a
  hold.
* :func:`plan_upsert`: an existing key that is leased answers ``ObjectHasLease`` (upsert would
  rewrite or free memory a reader is copying).
* :class:`PutAges`: which PROCESSING puts are stale (their writer vanished), judged on the
  leader's own monotonic clock, never on the wall-clock ``now`` the puts carry: a wall clock
  that jumps forward, or a new leader whose wall clock runs ahead, would otherwise free (and
  hand out again) memory a live writer is still writing (docs/store-master.md, "Clocks").
* :class:`HoldTracker`: which held tags are due for ``Release``. Tags the tracker was not
  told about (holds of an earlier leader, or slices of copies that lost a node, which
  ``apply`` holds by itself) are due one lease TTL after the tracker first sees them, and
  not before the new leader's blanket period ends: every lease on them was granted before.

Around every proposal that may free or rewrite a key's bytes (Remove, Upsert, Evict) the
service calls ``LeaseTable.block(keys)`` right after the lease check and ``unblock`` once
the entry applied (or the proposal failed), so no new lease is granted on a key in between:
the simulator finds that race otherwise (a reader leased a key between the check and the
apply, and its bytes were freed under it).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from ..errors import Code
from .commands import Release, Remove, RemovePrefix, Upsert
from .leases import DEFAULT_LEASE_TTL, LeaseTable

__all__ = [
    "RemovePlan",
    "UpsertPlan",
    "plan_remove",
    "plan_remove_prefix",
    "plan_upsert",
    "HoldTracker",
    "PutAges",
]


class RemovePlan(msgspec.Struct, frozen=True):
    """``codes[i]`` is final for keys refused here (non-zero) and ``0`` for keys in
    ``command`` (their code comes from the applied entry). ``command`` is None when nothing
    needs proposing. ``release_at``: when a hold may be released (0.0 if no hold)."""

    codes: list[int]
    command: Remove | None
    release_at: float = 0.0


class UpsertPlan(msgspec.Struct, frozen=True):
    codes: list[int]
    command: Upsert | None


def plan_remove(leases: LeaseTable, keys: list[str], now: float, force: bool = False) -> RemovePlan:
    codes = []
    send = []
    release_at = 0.0
    for k in keys:
        if leases.leased(k, now):
            if not force:
                codes.append(int(Code.OBJECT_HAS_LEASE))
                continue
            release_at = max(release_at, leases.expiry(k))
        codes.append(0)
        send.append(k)
    if not send:
        return RemovePlan(codes, None)
    hold = release_at > 0.0
    return RemovePlan(codes, Remove(send, force=force, hold=hold), release_at if hold else 0.0)


def plan_remove_prefix(
    prefix: str,
    found: list[str],
    skipped: int,
    more: bool,
    leases: LeaseTable,
    now: float,
    force: bool = False,
) -> tuple[RemovePrefix, float]:
    """The entry for one round of a remove by prefix and its hold's release time (0.0 if
    none). ``found``: the scan's keys (the scan already passed over keys leased when it
    saw them, counted in ``skipped``, unless ``force``). They are checked against the
    leases again here, synchronously with the caller's ``block``: a lease granted while a
    long scan yielded must not be missed."""
    plan = plan_remove(leases, found, now, force)
    keys = plan.command.keys if plan.command is not None else []
    skipped += len(found) - len(keys)
    cmd = RemovePrefix(prefix, keys, skipped, more, force, plan.release_at > 0.0)
    return cmd, plan.release_at


def plan_upsert(leases: LeaseTable, exists: list[bool], cmd: Upsert, now: float) -> UpsertPlan:
    """``exists[i]``: whether ``cmd.keys[i]`` is in the table (``sm.exists`` or PROCESSING)."""
    codes = []
    keys, sizes = [], []
    for k, size, ex in zip(cmd.keys, cmd.sizes, exists):
        # A key absent now may still be created by an earlier term's entry that the new
        # leader has not applied yet (and leased by that term's leader): the grace
        # period's judgement covers absent keys too.
        if leases.leased(k, now) if ex else leases.in_grace(k, now):
            codes.append(int(Code.OBJECT_HAS_LEASE))
            continue
        codes.append(0)
        keys.append(k)
        sizes.append(size)
    if not keys:
        return UpsertPlan(codes, None)
    return UpsertPlan(codes, msgspec.structs.replace(cmd, keys=keys, sizes=sizes))


class HoldTracker:
    """When each held tag (log index of the entry that held the bytes) may be released."""

    def __init__(self, ttl: float = DEFAULT_LEASE_TTL) -> None:
        self.ttl = ttl
        self._at: dict[int, float] = {}

    def note(self, tag: int, release_at: float) -> None:
        self._at[tag] = release_at

    def due(self, held_tags: Iterable[int], leases: LeaseTable, now: float) -> Release | None:
        """A ``Release`` for every held tag whose leases are over, or None."""
        tags = []
        for t in held_tags:
            at = self._at.get(t)
            if at is None:
                at = self._at[t] = now + self.ttl
            if now >= at and now >= leases.blanket_until:
                tags.append(t)
        return Release(sorted(tags)) if tags else None

    def forget(self, tags: Iterable[int]) -> None:
        for t in tags:
            self._at.pop(t, None)


class PutAges:
    """When this leader first saw each PROCESSING put ``(key, version)``, on its monotonic
    clock. A put is stale ``timeout`` after that: never earlier than its writer's own
    deadline (the writer counts from before it sent PutStart, which applied before any
    leader saw the put), whatever the wall clocks say. A new leader starts empty, so every
    put in flight gets a full timeout from when the new leader first looks."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, int], float] = {}

    def stale(
        self, puts: Iterable[tuple[str, int]], now: float, timeout: float, limit: int = 1 << 30
    ) -> list[tuple[str, int]]:
        """The puts among ``puts`` (the current PROCESSING ones) first seen at least
        ``timeout`` before ``now`` (at most ``limit``, oldest first); puts no longer listed
        are forgotten."""
        seen: dict[tuple[str, int], float] = {}
        old = self._seen
        out = []
        for kv in puts:
            t = old.get(kv, now)
            seen[kv] = t
            if now - t >= timeout:
                out.append((t, kv))
        self._seen = seen
        out.sort()
        return [kv for _, kv in out[:limit]]

    def __len__(self) -> int:
        return len(self._seen)
