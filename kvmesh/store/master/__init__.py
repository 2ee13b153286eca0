"""The store master's pure core: deterministic state machine, allocator, placement, and the
leader's soft state (leases, access order, heartbeats, eviction choice).

Nothing here does I/O or reads a clock or global randomness; the drivers (``kvmesh.store.
service``) feed ``now`` and propose :mod:`.commands` through the replicated log.
"""

from __future__ import annotations

from .eviction import EVICT_RATIO, HIGH_WATERMARK, EvictPlan, choose_victims
from .leases import (
    DEFAULT_LEASE_TTL,
    DEFAULT_NODE_TTL,
    AccessStats,
    HeartbeatTable,
    LeaseTable,
)
from .state import MasterConfig, StoreStateMachine

__all__ = [
    "DEFAULT_LEASE_TTL",
    "DEFAULT_NODE_TTL",
    "EVICT_RATIO",
    "HIGH_WATERMARK",
    "AccessStats",
    "EvictPlan",
    "HeartbeatTable",
    "LeaseTable",
    "MasterConfig",
    "StoreStateMachine",
    "choose_victims",
]
