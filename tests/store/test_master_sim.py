"""The store master in the deterministic simulator (kvmesh.store.master.sim): clean seeds hold
every store invariant and are linearizable; planted bugs are caught."""

from __future__ import annotations

import pytest

from kvmesh.replog.sim.linearizability import UNKNOWN, Operation, check
from kvmesh.store.master.sim import StoreModel, StoreOp, run_seed

CLEAN_SEEDS = range(10)
EXERCISED = (
    "reads_checked",
    "evictions",
    "expiries",
    "holds_released",
    "leader_changes",
    "restarts",
    "lease_expired_reads",
    "node_kills",
    "isolations",
    "drains",
    "snapshots_installed",
    "prefix_removes",
    "grace_exempt",
)
DURATION = 15.0


def test_clean_seeds_hold_every_invariant() -> None:
    totals: dict[str, int] = {}
    for seed in CLEAN_SEEDS:
        r = run_seed(seed, duration=DURATION)
        assert r.ok, (
            f"seed {seed}: {r.violation}\nreplay: python -m kvmesh.store.master.sim "
            f"--first {seed} --seeds 1 --duration {DURATION}"
        )
        assert r.lin_outcome == "ok"
        for f in EXERCISED:
            totals[f] = totals.get(f, 0) + getattr(r, f)
    # the runs exercised what the invariants are about
    assert all(v > 0 for v in totals.values()), totals
    assert totals["leader_changes"] > len(CLEAN_SEEDS)


def test_runs_are_deterministic() -> None:
    assert run_seed(3, duration=6.0) == run_seed(3, duration=6.0)


def _first_caught(plant: str, max_seeds: int = 12):
    for seed in range(max_seeds):
        r = run_seed(seed, duration=DURATION, plant=plant)
        if not r.ok:
            return seed, r
    return None, None


def test_planted_double_free_is_caught() -> None:
    """Release frees held bytes but keeps the hold, so the leader releases them again."""
    seed, r = _first_caught("double_free")
    assert r is not None, "a double free went unnoticed"
    assert "overlaps" in r.violation or "accounting" in r.violation or "raised" in r.violation, (
        r.violation
    )
    assert seed in CLEAN_SEEDS  # the same seed is clean without the bug


def test_planted_eviction_ignoring_leases_is_caught() -> None:
    seed, r = _first_caught("lease_ignored")
    assert r is not None, "eviction under a read lease went unnoticed"
    assert r.violation.startswith("lease:") or "foreign bytes" in r.violation, r.violation
    assert seed in CLEAN_SEEDS


def test_planted_lost_acknowledged_put_is_caught() -> None:
    """PutEnd acknowledges some puts without publishing them: the reads after it (and the
    final audit) make the history non-linearizable."""
    seed, r = _first_caught("lost_put")
    assert r is not None, "a lost acknowledged put went unnoticed"
    assert "ILLEGAL" in r.violation, r.violation
    assert seed in CLEAN_SEEDS


def test_planted_remove_prefix_ignoring_leases_is_caught() -> None:
    seed, r = _first_caught("prefix_lease_ignored")
    assert r is not None, "a remove by prefix under a read lease went unnoticed"
    assert r.violation.startswith("lease:") or "foreign bytes" in r.violation, r.violation
    assert seed in CLEAN_SEEDS


def test_planted_no_grace_period_is_caught() -> None:
    """A new leader that ignores the leases an earlier leader granted (no grace period at
    all) frees bytes readers are still copying: caught, on a seed that is clean with the
    narrowed grace of TermStart (objects created or completed in the new term are exempt,
    and the clean runs do free such objects inside a grace period: ``grace_exempt``)."""
    seed, r = _first_caught("no_grace")
    assert r is not None, "a new leader ignoring its predecessors' leases went unnoticed"
    assert r.violation.startswith("lease:") or "foreign bytes" in r.violation, r.violation
    assert seed in CLEAN_SEEDS


# slow: 16 s of CI for a detector that has caught nothing since the liveness scenario joined
@pytest.mark.slow
@pytest.mark.xfail(
    strict=False,
    reason="weak detector: it needs a leadership transfer while an old-term read of a re-put "
    "key is copying; 1 seed of 80 caught it before the liveness scenario joined the sim, "
    "none of the first 160 seeds since (the no-grace plant is still caught)",
)
def test_planted_over_narrow_grace_is_caught() -> None:
    """An over-narrow grace: a key counts as "created under this leader" once a put of it
    was proposed in the term, judged by name instead of by the version TermStart checks.
    A put of a key that already exists (ObjectExists: the old object stays) then exempts the
    old object, which an earlier leader leased, and its removal frees a reader's bytes."""
    seed, r = _first_caught("fresh_by_key", max_seeds=40)
    assert r is not None, "an over-narrow grace period went unnoticed"
    assert r.violation.startswith("lease:") or "foreign bytes" in r.violation, r.violation
    clean = run_seed(seed, duration=DURATION)
    assert clean.ok, clean.violation


SKEW = 6.0  # seconds: each replica's wall clock is off by up to this, and steps at faults
SKEW_SEEDS = range(10)


def test_wall_clock_skew_and_jumps_never_free_a_writers_memory() -> None:
    """Commands carry the proposing leader's wall clock. Stale PROCESSING puts used to be
    reclaimed by a wall-clock cutoff in apply (``Reclaim``): a leader whose clock ran ahead
    of the one that stamped the put (a step, or a new leader with a skewed clock) freed a
    put a live writer was still writing, and the memory went to another key (planted as
    ``wall_reclaim``: caught below). The leader now judges put ages on its monotonic clock
    and revokes stale puts by version; every invariant holds with skewed, jumping clocks."""
    for seed in SKEW_SEEDS:
        r = run_seed(seed, duration=DURATION, clock_skew=SKEW)
        assert r.ok, (
            f"seed {seed}: {r.violation}\nreplay: python -m kvmesh.store.master.sim "
            f"--first {seed} --seeds 1 --duration {DURATION} --clock-skew {SKEW}"
        )
        assert r.lin_outcome == "ok"
    caught = None
    for seed in SKEW_SEEDS:
        r = run_seed(seed, duration=DURATION, clock_skew=SKEW, plant="wall_reclaim")
        if not r.ok:
            caught = r
            break
    assert caught is not None, "a wall-clock reclaim under clock skew went unnoticed"
    assert caught.violation.startswith("write:"), caught.violation


def _op(client: int, inp: StoreOp, out, call: float, ret: float) -> Operation:
    return Operation(client, inp, call, out, ret)


def test_store_model_rejects_a_lost_put_and_an_overwrite() -> None:
    """The history checker itself: an acknowledged put that a later read misses, or a
    second put that succeeds on a present key, is not linearizable."""
    m = StoreModel()
    lost = [
        _op(1, StoreOp("put", "k", "v1"), "ok", 0.0, 1.0),
        _op(2, StoreOp("get", "k"), None, 2.0, 3.0),
    ]
    assert check(m, lost).outcome == "illegal"
    overwrite = [
        _op(1, StoreOp("put", "k", "v1"), "ok", 0.0, 1.0),
        _op(2, StoreOp("put", "k", "v2"), "ok", 2.0, 3.0),
    ]
    assert check(m, overwrite).outcome == "illegal"
    evicted = lost[:1] + [
        _op(0, StoreOp("drop", "k"), "ok", 1.5, 1.6),
        _op(2, StoreOp("get", "k"), None, 2.0, 3.0),
    ]
    assert check(m, evicted).outcome == "ok"
    pending = [
        _op(1, StoreOp("put", "k", "v1"), UNKNOWN, 0.0, float("inf")),
        _op(2, StoreOp("get", "k"), "v1", 2.0, 3.0),
        _op(3, StoreOp("exists", "k"), True, 4.0, 5.0),
    ]
    assert check(m, pending).outcome == "ok"
    pruned = lost[:1] + [
        _op(0, StoreOp("prune", "k"), None, 1.5, 1.6),
        _op(2, StoreOp("get", "k"), None, 2.0, 3.0),
    ]
    assert check(m, pruned).outcome == "ok"
    not_pruned = lost[:1] + [
        _op(0, StoreOp("prune", "k"), None, 1.5, 1.6),
        _op(2, StoreOp("get", "k"), "v1", 2.0, 3.0),
    ]
    assert check(m, not_pruned).outcome == "illegal"


@pytest.mark.slow
def test_soak() -> None:
    for seed in range(100, 160):
        r = run_seed(seed, duration=30.0)
        assert r.ok, f"seed {seed}: {r.violation}"


PAUSE_SEEDS = range(8)


def test_host_wide_pauses_of_two_ttls_expire_no_live_node() -> None:
    """Every replica stopped for 2x the node TTL, again and again: the nodes that kept
    heartbeating are never expired, the dead ones still are (the sim checks both)."""
    totals = {"pauses": 0, "node_kills": 0, "expiries": 0}
    for seed in PAUSE_SEEDS:
        r = run_seed(seed, duration=20.0, pause=3.0)  # node_ttl 1.5
        assert r.ok, f"seed {seed}: {r.violation}"
        for f in totals:
            totals[f] += getattr(r, f)
    assert all(v > 0 for v in totals.values()), totals


def test_planted_raw_gap_liveness_is_caught() -> None:
    """Liveness judged on the raw clock gap (the old rule): after a pause every node looks
    silent for the whole pause and live nodes are expired."""
    r = run_seed(0, duration=20.0, pause=3.0, plant="raw_gap")
    assert not r.ok and "which heartbeats" in r.violation, r.violation


def test_a_judge_that_never_expires_is_caught(monkeypatch) -> None:
    """The other promise: a dead node is expired in bounded time."""
    from kvmesh.store.master.liveness import LivenessJudge, Verdict

    real = LivenessJudge.tick

    def never(self, now, capacity):
        v = real(self, now, capacity)
        return Verdict([], v.suspect + v.expire, v.stalled)

    monkeypatch.setattr(LivenessJudge, "tick", never)
    caught = [r for r in (run_seed(s, duration=DURATION) for s in range(6)) if not r.ok]
    assert caught and "still mounted" in caught[0].violation, [r.violation for r in caught]


def test_planted_stale_heartbeat_judged_alive_is_caught() -> None:
    """The production leader (store/leader.py) judging every node alive at each tick,
    whatever its last heartbeat: a dead node is never expired."""
    seed, r = _first_caught("stale_alive", max_seeds=6)
    assert r is not None, "a leader that judges stale heartbeats alive went unnoticed"
    assert "still mounted" in r.violation, r.violation
    assert seed in CLEAN_SEEDS


def test_the_simulator_drives_the_production_leader() -> None:
    """The decisions the simulator checks are the service's own: one Leader class."""
    from kvmesh.store.leader import Leader
    from kvmesh.store.master.sim import SimConfig, StoreSim
    from kvmesh.store.service import MasterService, ServiceConfig

    sim = StoreSim(SimConfig(seed=0, duration=2.0))
    sim.run()
    svc = MasterService(ServiceConfig(listen="127.0.0.1:0", durability="memory"))
    assert type(sim.ldr) is Leader and type(svc.leader) is Leader
    assert sim.res.leader_changes >= 1 and sim.ldr.sm is sim.sms[sim.lead]
