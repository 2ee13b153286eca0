"""The store simulator's configuration, result and failure."""

from __future__ import annotations

import msgspec

__all__ = ["SimConfig", "SimResult", "SimViolation"]


class SimViolation(Exception):
    pass


class SimConfig(msgspec.Struct, kw_only=True):
    seed: int = 0
    duration: float = 20.0  # virtual seconds
    step: float = 0.01
    tick_every: int = 10  # steps per Raft tick
    n_clients: int = 4
    n_keys: int = 10
    n_nodes: int = 3
    segment_size: int = 2048
    slice_limit: int = 256
    lease_ttl: float = 0.5
    put_timeout: float = 2.0
    node_ttl: float = 1.5
    node_stage: float = 0.5  # the liveness judge's suspect stage (master/liveness.py)
    # host-wide pauses (every replica stopped at once, the storage nodes not) of this many
    # seconds among the faults; 0: none
    pause: float = 0.0
    faults: bool = True
    snapshot_every: int = 15
    clock_skew: float = 0.0  # max wall-clock offset of a replica, seconds (either way)
    # the disk tier: each storage node also mounts a disk segment of this many bytes
    # ("dsk-<node>") and does the demotions the leader gives it (0: no disk)
    disk_size: int = 0
    # promotion on hit: the leader's promote_hits (0: off); the nodes do the promotions
    promote_hits: int = 0
    plant: str | None = None


class SimResult(msgspec.Struct, kw_only=True):
    seed: int
    ok: bool
    violation: str = ""
    ops_ok: int = 0
    ops_unknown: int = 0
    entries: int = 0
    leader_changes: int = 0
    restarts: int = 0
    evictions: int = 0
    expiries: int = 0
    reads_checked: int = 0
    lease_expired_reads: int = 0
    holds_released: int = 0
    isolations: int = 0
    drains: int = 0
    snapshots_installed: int = 0
    node_kills: int = 0
    prefix_removes: int = 0
    transfers: int = 0  # leadership transfers
    grace_exempt: int = 0  # removes/upserts/evictions in a grace period of fresh keys
    pauses: int = 0
    demotions: int = 0  # disk copies made COMPLETE (the disk tier)
    disk_reads: int = 0  # reads served by a disk copy
    promotions: int = 0  # disk-only objects given a memory copy again (promotion on hit)
    lin_outcome: str = ""
