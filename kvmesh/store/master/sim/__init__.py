"""Deterministic simulation of the store master on the real Raft core, with store invariants.

Three master replicas (``kvmesh.replog`` cores on the hand-driven
:class:`~kvmesh.replog.sim.harness.Network`) each apply the committed log to their own
:class:`~.state.StoreStateMachine`. A virtual clock drives:

* the production leader (:class:`~kvmesh.store.leader.Leader`, the service's own soft state
  and decisions: leases and the new leader's grace, access order, node liveness, what each
  tick proposes, remove/upsert planning, eviction), driven as the service drives it: it
  mounts segments, expires silent storage nodes, reclaims stale puts, releases holds and
  evicts above the watermark;
* storage nodes whose segment bytes are modelled as one tag per slice (a checksum of key,
  version and slice number); a node that dies loses its bytes and comes back later;
* clients doing two-phase puts (write tags, then PutEnd; some soft- or hard-pinned), upserts,
  reads (read index, lookup, lease, a copy that takes time, then a byte check), exists,
  removes (sometimes forced) and removes by prefix (one round: the leader's scan, then one
  ``RemovePrefix`` entry);
* clocks: every replica has its own wall clock (``clock_skew``: offsets up to that many
  seconds either way, which also jump at fault time); commands carry the proposing
  leader's wall clock, leases and put ages run on the (monotonic) virtual clock;
* faults: leader isolation, replica restarts (state machine rebuilt from the storage's
  snapshot + log), snapshots with log compaction, storage nodes that die (and come back with a
  new segment once the old one expired) or leave gracefully (drain, then exit).

Checked on every step (:class:`SimViolation` names the first failure):

* :func:`~.invariants.check` on every replica (no overlapping live copies, allocator
  accounting, coalescing, distinct nodes per object, indexes);
* every read lease in force: its bytes still belong to that object version (never freed,
  reallocated or moved);
* every completed read returned exactly the bytes of the version it looked up;
* replicas that applied the same prefix have the same state digest.

At the end the network heals, every key is read through the leader (bytes checked), and the
put/get/exists/remove/evict history goes through :func:`kvmesh.replog.sim.linearizability.check`
with :class:`StoreModel`.

Negative controls (``plant``), each a bug planted in the real state machine or the real
leader for the run, must be caught: in the state machine ``"double_free"`` (Release frees a
hold but keeps it, so the leader releases it again) and ``"lost_put"`` (PutEnd acknowledges
puts it does not publish); in the leader ``"lease_ignored"`` (eviction ignores read leases),
``"prefix_lease_ignored"`` (a remove by prefix that ignores them), ``"no_grace"`` (a new
leader skips the grace period for its predecessors' leases), ``"fresh_by_key"`` (an
over-narrow grace: "put under this leader" judged by key name, not by
:class:`~.leases.TermStart`'s versions), ``"wall_reclaim"`` (stale puts reclaimed by the
wall-clock ``Reclaim`` cutoff, the old rule: with ``clock_skew`` a leader whose clock runs
ahead frees memory a writer is still writing) and ``"stale_alive"`` (every node judged alive
at each tick, whatever its last heartbeat); in the liveness judge ``"raw_gap"`` (liveness
judged on the raw clock gap, with ``pause``: a paused leader expires the nodes that kept
heartbeating). Node liveness: a serving node (it heartbeats) is never expired; a dead one
is expired within TTL + two stages + 1 s of a calm leader.
With ``disk_size`` (the disk tier, docs/store.md) every storage node also mounts a disk
segment and does the demotions its heartbeats are given (the copy takes a while; it reads
the memory copy at its end); checked besides: while a demotion is PROCESSING the memory copy
its node reads is still the object's, every COMPLETE disk copy holds its object's bytes, and
a found object always has a copy to read. ``"early_free"`` (a memory copy freed while its
disk copy is still PROCESSING, by the leader and apply) must be caught.
``python -m kvmesh.store.master.sim --seeds 50`` runs a batch (``--disk-size``).

Modules: ``cluster`` (the world: replicas, the leader driven as the service drives it, storage
nodes, faults, the main loop), ``clients`` (the client operations), ``checks`` (invariants
and the final audit), ``model`` (the sequential model), ``plants`` (the negative controls),
``config`` (configuration and result).
"""

from __future__ import annotations

from typing import Any

from .cluster import StoreSim
from .config import SimConfig, SimResult, SimViolation
from .model import StoreModel, StoreOp

__all__ = [
    "StoreOp",
    "StoreModel",
    "SimConfig",
    "SimResult",
    "SimViolation",
    "StoreSim",
    "main",
    "run_seed",
]


def run_seed(seed: int, **kw: Any) -> SimResult:
    return StoreSim(SimConfig(seed=seed, **kw)).run()


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--plant", default=None)
    p.add_argument("--clock-skew", type=float, default=0.0)
    p.add_argument("--pause", type=float, default=0.0, help="host-wide pauses of this long")
    p.add_argument("--disk-size", type=int, default=0, help="a disk segment per node (bytes)")
    a = p.parse_args(argv)
    bad = 0
    for s in range(a.first, a.first + a.seeds):
        r = run_seed(
            s, duration=a.duration, plant=a.plant, clock_skew=a.clock_skew, pause=a.pause,
            disk_size=a.disk_size,
        )  # fmt: skip
        print(
            f"seed {s}: {'ok' if r.ok else 'VIOLATION'} entries={r.entries} "
            f"reads={r.reads_checked} evictions={r.evictions} expiries={r.expiries} "
            f"drains={r.drains} holds={r.holds_released} "
            f"leaders={r.leader_changes} prefix={r.prefix_removes} lin={r.lin_outcome}"
            f" demotions={r.demotions} disk_reads={r.disk_reads}"
        )
        if not r.ok:
            bad += 1
            print("  " + r.violation.replace("\n", "\n  "))
    return 1 if bad else 0
