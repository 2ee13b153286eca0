"""Eviction victim choice (leader soft state, pure).

Above the high watermark (default 0.90 of capacity) the leader proposes an
:class:`~kvmesh.store.master.commands.Evict` entry that frees about ``evict_ratio`` (default
5 %) of capacity, oldest first in the leader's access order (:class:`AccessStamps`, the
table's stamp column, or :class:`AccessStats`): an approximate LRU, since a new leader
starts with every key equally old. Victims are COMPLETE objects that are not leased, not
blocked by a removal in flight and not hard-pinned;
soft-pinned objects whose pin is still live are taken only when the unpinned ones do not
free enough (then ``allow_soft`` is set so ``apply`` accepts them). ``apply`` re-checks each
victim (state, pins, version), so a victim that changed after the choice is skipped, never
wrongly freed.

The service blocks new leases on the victims (``LeaseTable.block``) from the moment it
chooses them until the Evict entry applied, or a reader could take a lease in between.

A put that found no space asks for ``need`` bytes: victims are then chosen even below the
watermark, until at least that much would be freed. ``objects``: the leader's object-count
cap asks for at least that many victims too (whatever bytes they hold), so eviction
triggers on either the byte watermark or the object count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from .leases import AccessStamps, AccessStats, LeaseTable

if TYPE_CHECKING:
    from .state import StoreStateMachine

__all__ = ["EVICT_RATIO", "HIGH_WATERMARK", "EvictPlan", "choose_victims"]

HIGH_WATERMARK = 0.90
EVICT_RATIO = 0.05


class EvictPlan(msgspec.Struct, frozen=True):
    """Victims (with the versions seen, for apply's re-check) and the bytes they hold.
    Propose ``Evict(keys, versions, now, allow_soft)`` when ``keys`` is non-empty."""

    keys: list[str]
    versions: list[int]
    allow_soft: bool
    bytes: int
    skipped_leased: int = 0
    skipped_pinned: int = 0


def choose_victims(
    sm: StoreStateMachine,
    leases: LeaseTable,
    stats: AccessStats | AccessStamps,
    now: float,
    high_watermark: float = HIGH_WATERMARK,
    evict_ratio: float = EVICT_RATIO,
    need: int = 0,
    max_keys: int = 65536,
    objects: int = 0,
    medium: str | None = None,
    copy: bool = False,
) -> EvictPlan:
    """Choose victims to free ``max(evict_ratio * capacity, need)`` bytes when usage is at or
    above ``high_watermark`` (or ``need > 0``); an empty plan otherwise or when nothing is
    evictable. Keys the access table does not know (objects that appeared since the table
    was reset) count as the oldest. ``objects``: also at least this many victims.
    ``medium``: the watermark and the bytes of that medium only, victims the objects whose
    copies there may be freed now (``StoreStateMachine.evict_info``; the disk tier).
    ``copy``: the victims are to be copied, not freed (demotion's DemoteStart): leased
    objects may be chosen too -- a lease forbids freeing a reader's bytes, not reading
    them; their memory is freed later only once no lease holds it (``Tiering.drop_demoted``,
    and this function's own choice of what to free)."""
    usage = sm.usage() if medium is None else sm.usage(medium)
    if usage.capacity <= 0 and objects <= 0:
        return EvictPlan([], [], False, 0)
    if need <= 0 and usage.used < high_watermark * usage.capacity:
        if objects <= 0:
            return EvictPlan([], [], False, 0)
        target = 0  # the object count alone asked
    else:
        target = max(int(evict_ratio * usage.capacity), need)
    keys: list[str] = []
    versions: list[int] = []
    soft: list[tuple[str, int, int]] = []
    got = 0
    leased = pinned = 0
    skip = sm.no_memory_to_free() if medium == "memory" and sm.has_disk() else None
    for key in _candidates(sm, stats, skip):
        if (got >= target and len(keys) >= objects) or len(keys) >= max_keys:
            break
        info = sm.evict_info(key) if medium is None else sm.evict_info(key, medium)
        if info is None:  # gone, or not COMPLETE
            continue
        version, nbytes, pin, pin_until = info
        if leases.blocked(key) or (not copy and leases.leased(key, now)):
            leased += 1
            continue
        if pin == 2:
            pinned += 1
            continue
        if pin == 1 and pin_until > now:
            soft.append((key, version, nbytes))
            continue
        keys.append(key)
        versions.append(version)
        got += nbytes
    allow_soft = False
    if (got < target or len(keys) < objects) and soft:
        allow_soft = True
        for key, version, nbytes in soft:
            if (got >= target and len(keys) >= objects) or len(keys) >= max_keys:
                break
            keys.append(key)
            versions.append(version)
            got += nbytes
    return EvictPlan(keys, versions, allow_soft, got, leased, pinned)


def _candidates(sm: StoreStateMachine, stats: AccessStats | AccessStamps, skip: Any = None):
    if len(stats) < sm.object_count():
        for k in sm.keys():  # noqa: SIM118 (a method, not a dict)
            if k not in stats:
                yield k
    yield from stats.oldest(skip)
