"""Negative controls: bugs planted in the real state machine, the real leader or the
liveness judge for one simulator run (the package docstring lists them)."""

from __future__ import annotations

import zlib
from contextlib import contextmanager
from typing import Any

from msgspec.structs import replace

from ...errors import Code
from ...leader import Leader
from ...tiering import Tiering
from .. import state as state_mod
from .. import tiers as tiers_mod
from ..commands import (
    PutEnd,
    Reclaim,
    Release,
)
from ..leases import LeaseTable
from ..liveness import LivenessJudge
from ..objects import TIER_DEMOTING, pack_layout
from ..policy import plan_remove_prefix
from ..state import StoreStateMachine

__all__ = ["planted"]


@contextmanager
def planted(plant: str | None, sim: Any):  # sim: the StoreSim (its term_keys)
    """Negative controls: plant a bug in the real state machine or the real leader
    (store/leader.py) for the run."""
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, fn: Any) -> None:
        patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, fn)

    if plant == "lost_put":
        orig_end = getattr(state_mod.StoreStateMachine, "_put_end")  # noqa: B009 (the plant replaces it)

        def lossy_put_end(self: StoreStateMachine, index: int, c: PutEnd):
            # acknowledges every key but never publishes some of them
            kept = [(k, v) for k, v in zip(c.keys, c.versions) if zlib.crc32(k.encode()) % 3]
            res = orig_end(self, index, PutEnd([k for k, _ in kept], [v for _, v in kept]))
            return type(res)([0] * len(c.keys))

        patch(state_mod.StoreStateMachine, "_put_end", lossy_put_end)
    elif plant == "raw_gap":
        # the old rule: liveness judged on the raw clock gap, a stopped leader's own pause
        # counted as the nodes' silence
        def raw_advance(self: LivenessJudge, now: float) -> bool:
            if now > self._seen:
                self.heard += now - self._seen
                self._seen = now
            return False

        patch(LivenessJudge, "_advance", raw_advance)
    elif plant == "double_free":
        patch(state_mod.StoreStateMachine, "_release", _leaky_release)
        patch(Leader, "released", lambda self, cmd, result: None)  # and released again
    elif plant == "lease_ignored":
        orig_evict = Leader.eviction

        def evict_unleased(self: Leader, now: float, wall: float, need=0, objects=0):
            real, self.leases = self.leases, LeaseTable()  # the choice sees no lease
            try:
                cmd = orig_evict(self, now, wall, need, objects)
            finally:
                self.leases = real
            if cmd is not None:
                real.block(cmd.keys)  # evicted() unblocks them there
            return cmd

        patch(Leader, "eviction", evict_unleased)
    elif plant == "prefix_lease_ignored":
        patch(Leader, "prefix_leased", lambda self, now, force: None)
        patch(
            Leader,
            "plan_remove_prefix",
            lambda self, prefix, found, skipped, more, now, force: plan_remove_prefix(
                prefix, found, skipped, more, LeaseTable(), now, force
            ),
        )
    elif plant == "no_grace":  # a new leader skips the grace period (as if alone)
        orig_elected = Leader.elected
        patch(
            Leader,
            "elected",
            lambda self, now, first, applied, alone=False: orig_elected(
                self, now, first, applied, True
            ),
        )
    elif plant == "fresh_by_key":  # "a key put under this leader" judged by name
        orig_fresh = Leader.fresh
        patch(Leader, "fresh", lambda self, key: key in sim.term_keys or orig_fresh(self, key))
    elif plant == "wall_reclaim":  # the old rule: a wall-clock cutoff in apply
        patch(
            Leader,
            "reclaim",
            lambda self, now, wall: [Reclaim(wall, self.cfg.put_timeout_s)],
        )
    elif plant == "stale_alive":
        # every node the table holds judged alive at each tick, whatever its last heartbeat
        orig_expiry = Leader.expiry

        def expiry_fresh(self: Leader, now: float, wall: float):
            self.liveness.reset(self.sm.nodes(), now)
            return orig_expiry(self, now, wall)

        patch(Leader, "expiry", expiry_fresh)
    elif plant == "early_free":
        # the disk tier's rule broken: a memory copy freed while its disk copy is still
        # PROCESSING (chosen by the leader and accepted by apply)
        orig_info = tiers_mod.Tiers.evict_info

        def info_demoting(self: Any, key: str, medium: str | None = None):
            if medium == "memory" and self.tier_of(key) == TIER_DEMOTING:
                o = self.objects[key]
                return o.version, self.medium_bytes(o, "memory"), o.pin, o.pin_until
            return orig_info(self, key, medium)

        orig_split = Tiering.split

        def split_early(self: Tiering, keys: list[str], versions: list[int]):
            early = [(k, v) for k, v in zip(keys, versions) if self.sm.tier_of(k) == TIER_DEMOTING]
            drop, rest = orig_split(self, keys, versions)
            if early:
                dk, dv = drop or ([], [])
                drop = (dk + [k for k, _ in early], dv + [v for _, v in early])
                if rest is not None:
                    keep = [(k, v) for k, v in zip(*rest) if (k, v) not in early]
                    rest = ([k for k, _ in keep], [v for _, v in keep]) if keep else None
            return drop, rest

        orig_drop = getattr(tiers_mod.Tiers, "_drop_replica")  # noqa: B009 (the plant replaces it)

        def drop_early(self: Any, index: int, c: Any):
            for key, version in zip(c.keys, c.versions):
                o = self.objects.get(key)
                if o is not None and o.tier == TIER_DEMOTING and o.version == version:
                    copies, lens = self._copies(o)
                    for copy in copies[:-1]:
                        self._free_copy(copy, lens)
                    self.objects[key] = replace(o, layout=pack_layout(copies[-1:]))
            return orig_drop(self, index, c)

        patch(tiers_mod.Tiers, "evict_info", info_demoting)
        patch(Tiering, "split", split_early)
        patch(tiers_mod.Tiers, "_drop_replica", drop_early)
    elif plant is not None:
        raise ValueError(f"unknown plant {plant!r}")
    try:
        yield
    finally:
        for owner, name, orig in reversed(patches):
            setattr(owner, name, orig)


def _leaky_release(self: StoreStateMachine, index: int, c: Release):
    """Release that frees the held bytes but keeps the hold (the double_free plant)."""
    from .commands import Codes

    codes = []
    for tag in c.tags:
        ext = self.held.get(tag)
        if ext is None:
            codes.append(int(Code.OBJECT_NOT_FOUND))
            continue
        for sid, off, ln in ext:
            seg = self.segs.get(sid)
            if seg is not None:
                try:
                    seg.alloc.free(off, ln)
                except Exception:
                    pass
        codes.append(0)
    return Codes(codes)
