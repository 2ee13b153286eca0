"""Scripted leader crashes on the seeded simulator: how long a write waits after the leader
dies, in ticks of virtual time (no wall clock, so the figure is the same on any machine).

One round mimics ``bench/_failover.py``: a 3-voter cluster with unaligned tickers elects a
leader; a follower is crashed and restarted and catches up (so one survivor is a recently
restarted replica); the leader is crashed at a random point of a tick and restarted either
after a new leader commits (as the bench does) or while the election runs. The result is
the time from the crash to a new leader's first commit in its own term, which is when the
store can acknowledge writes again. Run ``python -m kvmesh.replog.sim.failover`` for the
distribution over many seeds.
"""

from __future__ import annotations

import argparse
import random

import msgspec

from ..types import RaftConfig, ReadOnlyOption, Role
from .cluster import SimConfig, Simulator

__all__ = ["FailoverResult", "failover_round", "failover_ticks"]

_POLL = 0.1  # ticks between two looks at the cluster (the resolution of the result)


class FailoverResult(msgspec.Struct, kw_only=True):
    seed: int
    ticks: float | None  # crash -> a new leader's first commit in its term; None: none in limit
    elections: int  # distinct (node, PreVote or Vote, term) requests seen after the crash
    leader: int | None
    terms: int  # the new leader's term minus the crashed one's: 1 = a single election round


def _config(seed: int, election_tick: int, n_voters: int, lease: bool, delay: float, jitter: float):
    raft = RaftConfig(
        election_tick=election_tick,
        max_election_tick=2 * election_tick,
        heartbeat_tick=1,
        read_only_option=ReadOnlyOption.LEASE_BASED if lease else ReadOnlyOption.SAFE,
    )
    return SimConfig(
        seed=seed,
        n_voters=n_voters,
        n_clients=0,
        tick=0.05,
        raft=raft,
        nemesis=False,
        buggify=False,
        net_delay=delay,
        net_jitter=jitter,
        tick_phase=True,
    )


def failover_round(
    seed: int,
    *,
    election_tick: int = 10,
    n_voters: int = 3,
    lease: bool = True,
    delay: float = 0.0005,
    jitter: float = 0.03,
    restart: str = "after",
    limit_ticks: int = 200,
) -> FailoverResult:
    """One crash of the leader (see the module docstring); ``delay`` and ``jitter`` are the
    one-way message delay in seconds of a 50 ms tick, ``restart`` is "after" or "during"."""
    cfg = _config(seed, election_tick, n_voters, lease, delay, jitter)
    sim = Simulator(cfg)
    rng = random.Random(seed ^ 0xFA11)
    tick = cfg.tick
    sim.run_until(4 * cfg.election_max_s)
    lead = sim.leader_id()
    if lead is None:
        raise AssertionError(f"seed {seed}: no leader before the crash")
    follower = rng.choice([i for i in sim.nodes if i != lead])
    sim.crash(follower)
    sim.run_until(sim.now + rng.uniform(4, 20) * tick)
    sim.restart(follower)
    sim.run_until(sim.now + rng.uniform(10, 60) * tick)
    lead = sim.leader_id()
    if lead is None:
        raise AssertionError(f"seed {seed}: no leader after the follower's restart")
    old_term = sim.nodes[lead].core.term
    sim.run_until(sim.now + rng.random() * tick)
    sim.crash(lead)
    t_crash = sim.now
    back_at = t_crash + rng.uniform(2, 2 * election_tick) * tick if restart == "during" else None
    while sim.now - t_crash < limit_ticks * tick:
        sim.run_until(sim.now + _POLL * tick)
        if back_at is not None and sim.now >= back_at:
            sim.restart(lead)
            back_at = None
        for i, n in sim.nodes.items():
            c = n.core
            if n.alive and c.role == Role.LEADER and c.term > old_term:
                log = c.log
                if log.committed and log.term(log.committed) == c.term:
                    return FailoverResult(
                        seed=seed,
                        ticks=(sim.now - t_crash) / tick,
                        elections=_campaigns_since(sim, t_crash),
                        leader=i,
                        terms=c.term - old_term,
                    )
    return FailoverResult(
        seed=seed, ticks=None, elections=_campaigns_since(sim, t_crash), leader=None, terms=0
    )


def _campaigns_since(sim: Simulator, t: float) -> int:
    """Distinct (node, term) pre-campaigns and campaigns seen in the trace since ``t``."""
    seen = set()
    for when, kind, node, m in sim.trace:
        if when >= t and kind == "msg" and type(m).__name__ in ("PreVote", "Vote"):
            seen.add((node, type(m).__name__, m.term))
    return len(seen)


def failover_ticks(seeds, **kw) -> list[FailoverResult]:
    return [failover_round(s, **kw) for s in seeds]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--delay", type=float, default=0.0005)
    ap.add_argument("--jitter", type=float, default=0.03)
    ap.add_argument("--restart", choices=("after", "during"), default="after")
    ap.add_argument("--voters", type=int, default=3)
    ap.add_argument("--safe", action="store_true", help="ReadIndex reads (no lease mode)")
    a = ap.parse_args()
    res = failover_ticks(
        range(a.seeds),
        delay=a.delay,
        jitter=a.jitter,
        restart=a.restart,
        n_voters=a.voters,
        lease=not a.safe,
    )
    ts = sorted(r.ticks if r.ticks is not None else float("inf") for r in res)
    q = lambda p: ts[min(len(ts) - 1, int(p * len(ts)))]  # noqa: E731
    print(f"ticks crash->commit over {len(ts)} seeds: ", end="")
    print(f"p50 {q(0.5):.1f} p99 {q(0.99):.1f} max {ts[-1]:.1f}")
    slow = [(r.seed, round(r.ticks or -1, 1)) for r in res if (r.ticks or 1e9) > 21]
    print(f"over 21 ticks: {len(slow)} {slow[:20]}")
    rounds = [(r.seed, r.terms) for r in res if r.terms != 1]
    print(f"more than one election round: {len(rounds)} {rounds[:20]}")


if __name__ == "__main__":
    main()
