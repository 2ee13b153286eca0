"""Object records and the replica lifecycle.

An object's copies move through their states together (the client writes every copy, then one
``PutEnd`` completes them all), so the state is kept once per object. :data:`TRANSITIONS` is
the whole lifecycle: ``apply`` looks every state change up in it (:func:`next_state`) and an
event the table does not list for the current state is refused, never improvised.

::

      PutStart/Upsert(new)          PutEnd
    ─────────────────────> PROCESSING ─────> COMPLETE ──┐ Upsert (same size: reuse)
                             │   ^                │     │
     PutRevoke, Reclaim,     │   └────────────────┼─────┘
     NodeLost(last copy)     v                    v  Remove, Evict, RemoveAll,
                           GONE                 GONE   NodeLost(last copy), Upsert (new size)

Remove never takes a PROCESSING object, not even forced: its writer may still be writing
into the bytes (it stops by the put timeout; ``Reclaim`` frees them after it). A forced
remove only overrides read leases, by holding the bytes (see ``policy.py``).

Slices are packed into ``layout``: per copy, per slice, ``(segment id u32, offset u64)``
little-endian; slice ``i`` is ``min(slice_limit, size - i*slice_limit)`` bytes long, so
lengths are implied. One copy of one slice costs 12 bytes of layout.
"""

from __future__ import annotations

import enum
import struct
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from ..types import ReplicateConfig

__all__ = [
    "PIN_HARD",
    "PIN_NONE",
    "PIN_SOFT",
    "SLICE",
    "TIER_DEMOTING",
    "TIER_DISK",
    "TIER_NONE",
    "TRANSITIONS",
    "Event",
    "Obj",
    "State",
    "n_slices",
    "next_state",
    "pack_layout",
    "pin_of",
    "slice_lengths",
    "unpack_layout",
]


class State(enum.IntEnum):
    GONE = 0  # not in the table (freed)
    PROCESSING = 1
    COMPLETE = 2


class Event(enum.IntEnum):
    PUT_START = 0  # allocate copies for an absent key
    PUT_END = 1
    PUT_REVOKE = 2
    RECLAIM = 3  # writer vanished: PROCESSING older than the put timeout
    REMOVE = 4
    EVICT = 6
    NODE_LOST = 7  # the last copy's node expired or its segment was unmounted
    UPSERT_REUSE = 8  # same size and copy count: rewrite in place
    UPSERT_REPLACE = 9  # new allocation; the old copies are freed
    PUT_COMMIT = 10  # written into the writer's reservation first: published at once


P, C, G = State.PROCESSING, State.COMPLETE, State.GONE

TRANSITIONS: dict[tuple[State, Event], State] = {
    (G, Event.PUT_START): P,
    (G, Event.UPSERT_REPLACE): P,
    (G, Event.PUT_COMMIT): C,
    (P, Event.PUT_END): C,
    (P, Event.PUT_REVOKE): G,
    (P, Event.RECLAIM): G,
    (P, Event.NODE_LOST): G,
    (C, Event.PUT_END): C,  # a repeated PutEnd of the same version is a no-op
    (C, Event.REMOVE): G,
    (C, Event.EVICT): G,
    (C, Event.NODE_LOST): G,
    (C, Event.UPSERT_REUSE): P,
    (C, Event.UPSERT_REPLACE): P,
}
"""The replica lifecycle: (state, event) -> next state. Anything absent is refused."""


def next_state(state: int, event: Event) -> State | None:
    """The state after ``event``, or None if the lifecycle does not allow it."""
    return TRANSITIONS.get((state, event))  # IntEnum keys hash and compare as ints


PIN_NONE, PIN_SOFT, PIN_HARD = 0, 1, 2


class Obj(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One object. Immutable: ``apply`` replaces a record instead of changing it, so a
    shallow copy of the table is a consistent snapshot image."""

    size: int
    # The state the record was written with. The current state is the PROCESSING index of
    # the state machine (``StoreStateMachine.processing``: a key there is PROCESSING, any
    # other key of the table COMPLETE), so a PutEnd publishes without rewriting the record.
    state: int
    version: int  # log index of the PutStart/Upsert that allocated it
    started: float  # the proposing leader's clock at that entry (for Reclaim)
    layout: bytes  # see the module docstring
    pin: int = PIN_NONE
    pin_until: float = 0.0
    # the disk tier (``tiers.py``): TIER_NONE, or the layout's last copy is a disk copy,
    # PROCESSING (TIER_DEMOTING: a demotion in flight, never read) or COMPLETE (TIER_DISK,
    # its bytes' crc32c in ``crc``); every other copy is in memory
    tier: int = 0
    crc: int = 0


TIER_NONE, TIER_DEMOTING, TIER_DISK = 0, 1, 2

SLICE = struct.Struct("<IQ")


def n_slices(size: int, slice_limit: int) -> int:
    return -(-size // slice_limit)


def slice_lengths(size: int, slice_limit: int) -> list[int]:
    n = n_slices(size, slice_limit)
    return [slice_limit] * (n - 1) + [size - slice_limit * (n - 1)]


def pack_layout(copies: list[list[tuple[int, int]]]) -> bytes:
    """``copies[r][i] = (segment id, offset)`` -> packed layout."""
    pack = SLICE.pack
    return b"".join(pack(s, o) for copy in copies for s, o in copy)


def unpack_layout(layout: bytes, nslices: int) -> list[list[tuple[int, int]]]:
    flat = list(SLICE.iter_unpack(layout))
    return [flat[i : i + nslices] for i in range(0, len(flat), nslices)]


def pin_of(cfg: ReplicateConfig, now: float, ttl: float) -> tuple[int, float]:
    """``(pin, pin_until)`` of a record put with ``cfg`` at ``now`` (soft pins last ``ttl``)."""
    if cfg.hard_pin:
        return PIN_HARD, 0.0
    if cfg.soft_pin:
        return PIN_SOFT, now + ttl
    return PIN_NONE, 0.0
