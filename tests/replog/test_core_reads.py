"""Linearizable reads without log entries: ReadIndex (batched heartbeat rounds), follower
reads, and leader leases (notes §4.4)."""

from __future__ import annotations

import pytest

from kvmesh.replog.sim.harness import Network
from kvmesh.replog.types import (
    Heartbeat,
    HeartbeatResp,
    NotLeader,
    RaftConfig,
    ReadIndex,
    ReadOnlyOption,
    Role,
)

SAFE = RaftConfig(election_tick=10, heartbeat_tick=1)
LEASE = RaftConfig(election_tick=10, heartbeat_tick=1, read_only_option=ReadOnlyOption.LEASE_BASED)


def cluster(cfg: RaftConfig = SAFE, ids=(1, 2, 3)) -> Network:
    n = Network(ids, cfg)
    if cfg.read_only_option is ReadOnlyOption.LEASE_BASED:
        # Freshly booted nodes withhold votes for one election timeout in lease mode.
        n.add_filter(lambda m: False)
        n.tick_all(cfg.election_tick)
        n.recover()
    n.elect(1)
    assert n.leader() == 1
    n.tick_all(2)
    return n


def test_read_index_waits_for_quorum_round() -> None:
    n = cluster()
    idx = n.propose(1, b"w")
    n.isolate(1)
    n[1].read_index(b"r1")
    n.stabilize()
    assert n.nodes[1].read_states == []  # no quorum has confirmed leadership
    n.recover()
    n[1].tick()
    n.stabilize()
    assert [(r.index, r.context) for r in n.nodes[1].read_states] == [(idx, b"r1")]


def test_read_index_batches_requests_into_one_round() -> None:
    n = cluster()
    for i in range(10):
        n[1].read_index(b"r%d" % i)
    n.flush()
    hbs = [m for m in n.queue if type(m) is Heartbeat]
    assert len(hbs) == 2  # one round to each follower serves all ten reads
    n.stabilize()
    assert [r.context for r in n.nodes[1].read_states] == [b"r%d" % i for i in range(10)]
    assert len({r.index for r in n.nodes[1].read_states}) == 1


def test_no_read_index_before_leader_commits_its_noop() -> None:
    n = Network([1, 2, 3], SAFE)
    n.add_filter(lambda m: type(m).__name__ != "AppendResp")  # the no-op cannot commit
    n.elect(1)
    assert n[1].role == Role.LEADER
    n[1].read_index(b"early")
    n.tick_all(2)
    assert n.nodes[1].read_states == []
    n.recover()
    n.tick_all(2)
    rs = n.nodes[1].read_states
    assert [r.context for r in rs] == [b"early"]
    assert n[1].log.term(rs[0].index) == n[1].term  # at or after the no-op


def test_follower_read_via_leader() -> None:
    n = cluster()
    idx = n.propose(1, b"w")
    n[3].read_index(b"f")
    n.stabilize()
    rs = n.nodes[3].read_states
    assert [(r.index, r.context) for r in rs] == [(idx, b"f")]
    # The leader pushes its commit index with the answer, so the follower can serve soon.
    assert n[3].log.committed >= idx


def test_read_without_leader_raises() -> None:
    n = Network([1, 2, 3], SAFE)
    with pytest.raises(NotLeader):
        n[2].read_index(b"x")


def test_pending_reads_dropped_on_step_down() -> None:
    n = cluster()
    n.isolate(1)
    n[1].read_index(b"lost")
    n.tick_all(3 * 20)
    assert n[1].role != Role.LEADER
    assert n.nodes[1].read_states == []
    assert not n[1].readonly.has_pending()


def test_stale_heartbeat_responses_do_not_confirm() -> None:
    """Echoes of a previous term's rounds are ignored (they carry an older term)."""
    n = cluster()
    n[1].read_index(b"r")
    n.flush()
    n.queue = []  # the round is lost
    n[1].step(HeartbeatResp(2, 1, n[1].term - 1, ctx=10**6))
    n.flush()
    assert n.nodes[1].read_states == []


def test_read_rounds_count_only_voters() -> None:
    n = Network([1, 2, 3, 4], SAFE, voters=[1, 2, 3], learners=[4])
    n.elect(1)
    n.tick_all(2)
    n.cut(1, 2)
    n.cut(1, 3)
    n[1].read_index(b"r")
    n.stabilize()
    assert n.nodes[1].read_states == []  # the learner's echo does not make a quorum


# -- leases --------------------------------------------------------------------------------


def test_lease_read_answers_without_a_round() -> None:
    n = cluster(LEASE)
    assert n[1].lease_valid()
    n[1].read_index(b"l")
    n.flush()
    assert [r.context for r in n.nodes[1].read_states] == [b"l"]
    assert not [m for m in n.queue if type(m) is Heartbeat]


def test_lease_expires_without_acknowledgements_then_falls_back() -> None:
    n = cluster(LEASE)
    n.isolate(1)
    lease = LEASE.lease_ticks
    for _ in range(lease):
        n.tick(1)
    assert not n[1].lease_valid()
    n[1].read_index(b"late")
    n.stabilize()
    assert n.nodes[1].read_states == []  # needs a quorum round now, which cannot happen
    assert lease < LEASE.election_tick - 1


def test_lease_valid_measured_from_round_send_time() -> None:
    n = cluster(LEASE)
    n.isolate(1)
    for t in range(LEASE.lease_ticks - 1):
        n.tick(1)
        assert n[1].lease_valid(), t


def test_lease_revoked_by_leader_transfer() -> None:
    n = cluster(LEASE)
    assert n[1].lease_valid()
    n.isolate(2)
    n[1].transfer_leader(3)  # 3 is up to date: TimeoutNow goes out at once
    assert not n[1].lease_valid()
    n[1].read_index(b"x")
    n.flush()
    assert n.nodes[1].read_states == []


def test_follower_read_in_lease_mode() -> None:
    n = cluster(LEASE)
    idx = n.propose(1, b"w")
    n[2].read_index(b"fr")
    n.stabilize()
    assert [(r.index, r.context) for r in n.nodes[2].read_states] == [(idx, b"fr")]


def test_read_index_from_unknown_node_ignored() -> None:
    n = cluster()
    n[1].step(ReadIndex(9, 1, n[1].term, b"x"))
    n.stabilize()
    assert not n[1].readonly.has_pending()


def test_lease_config_requires_check_quorum() -> None:
    with pytest.raises(ValueError, match="check_quorum"):
        RaftConfig(read_only_option=ReadOnlyOption.LEASE_BASED, check_quorum=False)


def test_lease_ticks_formula() -> None:
    assert RaftConfig(election_tick=10, lease_drift_bound=0.1).lease_ticks == 8
    assert RaftConfig(election_tick=20, lease_drift_bound=0.25).lease_ticks == 14
    assert RaftConfig(election_tick=10, lease_drift_bound=0.0).lease_ticks == 9
