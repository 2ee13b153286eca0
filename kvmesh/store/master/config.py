"""The master's replicated configuration (:class:`MasterConfig`)."""

from __future__ import annotations

import msgspec

__all__ = ["MasterConfig"]


class MasterConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Replicated configuration: every master replica must use the same one (a snapshot
    carries it and restore adopts it). ``slice_limit``: longest slice of one copy;
    ``align``: allocation granularity (power of two)."""

    slice_limit: int = 16 << 20
    align: int = 64
    remount_quarantine: float = 60.0
    """Seconds (of entry time) during which a dropped segment's name cannot be mounted
    again: a reader still copying under a lease from the old segment must not read the
    new segment's bytes at the same name and offsets, nor a writer that is still writing
    until its put timeout. Keep it >= max(read lease TTL, put timeout)."""
