"""Leadership transfer (A8) and single-server membership changes (D1-D6)."""

from __future__ import annotations

import pytest

from kvmesh.replog.sim.harness import Network
from kvmesh.replog.types import (
    AppendResp,
    ConfChange,
    ConfChangeError,
    ConfChangeType,
    LeaderTransferError,
    NotLeader,
    ProposalDropped,
    RaftConfig,
    Role,
    TimeoutNow,
)

CFG = RaftConfig(election_tick=10, heartbeat_tick=1)
ADD_VOTER = int(ConfChangeType.ADD_VOTER)
ADD_LEARNER = int(ConfChangeType.ADD_LEARNER)
REMOVE = int(ConfChangeType.REMOVE_NODE)
PROMOTE = int(ConfChangeType.PROMOTE_LEARNER)


def cluster(ids=(1, 2, 3), cfg: RaftConfig = CFG) -> Network:
    n = Network(ids, cfg)
    n.elect(1)
    assert n.leader() == 1
    n.tick_all(2)
    return n


def change(n: Network, leader: int, cc_type: int, node: int) -> int:
    idx = n[leader].propose_conf_change(ConfChange(cc_type, node))
    n.stabilize()
    n.tick_all(2)
    return idx


# -- A8: leadership transfer ------------------------------------------------------------------


def test_transfer_to_up_to_date_follower() -> None:
    n = cluster()
    term = n[1].term
    n[1].transfer_leader(2)
    sent = n.stabilize()
    assert any(type(m) is TimeoutNow and m.to == 2 for m in sent)
    assert n.leader() == 2 and n[2].term == term + 1
    n.propose(2, b"after-transfer")
    assert n[2].log.committed == n[2].log.last_index()


def test_transfer_to_lagging_follower_catches_it_up_first() -> None:
    n = cluster()
    n.isolate(3)
    for i in range(20):
        n[1].propose(b"x%d" % i)
    n.stabilize()
    n.recover()
    n[1].transfer_leader(3)
    with pytest.raises(ProposalDropped, match="transfer"):
        n[1].propose(b"during-transfer")
    n.stabilize()
    assert n.leader() == 3
    assert n.nodes[3].core.log.last_index() >= n.nodes[2].core.log.last_index()
    n.tick_all(2)
    assert n.nodes[3].applied_data()[:20] == [b"x%d" % i for i in range(20)]


def test_transfer_times_out_and_proposals_resume() -> None:
    n = cluster()
    n.isolate(3)
    n[1].transfer_leader(3)
    assert n[1].lead_transferee == 3
    n.tick(1, CFG.election_tick)
    assert n[1].lead_transferee == 0 and n[1].role == Role.LEADER
    n[1].propose(b"ok-again")


def test_transfer_errors() -> None:
    n = cluster()
    with pytest.raises(LeaderTransferError):
        n[1].transfer_leader(9)
    with pytest.raises(NotLeader) as ei:
        n[2].transfer_leader(3)
    assert ei.value.leader_hint == 1
    n[1].transfer_leader(1)  # no-op
    assert n[1].lead_transferee == 0


# -- D1-D6: membership ---------------------------------------------------------------------------


def test_d1_add_learner_catch_up_promote_quorum_switch() -> None:
    n = cluster()
    for i in range(10):
        n[1].propose(b"d%d" % i)
    n.stabilize()
    n.add_node(4)
    change(n, 1, ADD_LEARNER, 4)
    assert n[1].learners == (4,) and n[4].learners == (4,)
    assert n.nodes[4].applied_data() == [b"d%d" % i for i in range(10)]
    assert n[1].prs[4].match == n[1].log.last_index()
    # A learner does not count for commit: with 2 and 3 down nothing commits.
    n.isolate(2)
    n.isolate(3)
    idx = n[1].propose(b"needs-a-voter")
    n.stabilize()
    assert n[1].log.committed < idx
    n.recover()
    n.stabilize()
    change(n, 1, PROMOTE, 4)
    assert n[1].voters == (1, 2, 3, 4) and n[1].learners == ()
    # Now 3 of 4 are needed: with two voters down nothing commits, with one it does.
    n.isolate(2)
    n.isolate(3)
    idx = n[1].propose(b"3-of-4")
    n.stabilize()
    assert n[1].log.committed < idx
    n.recover()
    n.isolate(3)
    n.stabilize()
    n.tick_all(2)
    assert n[1].log.committed >= idx


def test_d2_remove_leader_commits_then_steps_down() -> None:
    n = cluster()
    idx = n[1].propose_conf_change(ConfChange(REMOVE, 1))
    n.stabilize()
    assert n[1].role == Role.FOLLOWER
    assert n[1].voters == (2, 3)
    assert n[2].log.committed >= idx or n[3].log.committed >= idx
    n.tick_all(3 * 20)
    new = n.leader()
    assert new in (2, 3)
    n.propose(new, b"without-1")
    assert n[new].log.committed == n[new].log.last_index()
    # The old leader cannot campaign any more.
    n.tick(1, 50)
    assert n[1].role == Role.FOLLOWER


def test_d2_removed_leader_hands_over_quickly() -> None:
    n = cluster()
    n[1].propose_conf_change(ConfChange(REMOVE, 1))
    sent = n.stabilize()
    assert any(type(m) is TimeoutNow for m in sent)
    assert len(n.leaders()) == 1 and n.leader() in (2, 3)


def test_d3_removed_partitioned_node_cannot_disrupt() -> None:
    n = cluster()
    n.isolate(3)
    change(n, 1, REMOVE, 3)
    assert n[1].voters == (1, 2)
    term = n[1].term
    n.tick(3, 10 * 20)  # 3 never learned its removal; it keeps trying to campaign
    n.recover()
    n.tick_all(20)
    assert n.leader() == 1 and n[1].term == term and n[2].term == term


def test_d4_replace_node_with_leader_crash_between_steps() -> None:
    n = cluster()
    n.add_node(4)
    change(n, 1, ADD_LEARNER, 4)
    n.restart(1)  # leader crash after step 1
    n.tick_all(3 * 20)
    lid = n.leader()
    n.tick_all(2)
    change(n, lid, PROMOTE, 4)
    assert set(n[lid].voters) == {1, 2, 3, 4}
    n.restart(lid)  # crash after step 2
    n.tick_all(3 * 20)
    lid = n.leader()
    n.tick_all(2)
    victim = 1 if lid != 1 else 2
    change(n, lid, REMOVE, victim)
    n.tick_all(20)
    lid = n.leader()
    assert victim not in n[lid].voters and 4 in n[lid].voters
    n.propose(lid, b"replaced")
    n.tick_all(2)
    assert n.nodes[4].applied_data()[-1] == b"replaced"


def test_d5_second_change_rejected_until_first_applies() -> None:
    n = cluster()
    n.add_node(4)
    n.add_node(5)
    n.add_filter(lambda m: type(m) is not AppendResp)  # keep the first change uncommitted
    n[1].propose_conf_change(ConfChange(ADD_LEARNER, 4))
    with pytest.raises(ProposalDropped, match="pending"):
        n[1].propose_conf_change(ConfChange(ADD_LEARNER, 5))
    n.recover()
    n.stabilize()
    n.tick_all(2)
    n[1].propose_conf_change(ConfChange(ADD_LEARNER, 5))


def test_d6_change_refused_before_leader_commits_its_noop() -> None:
    n = Network([1, 2, 3], CFG)
    n.add_filter(lambda m: type(m) is not AppendResp)
    n.elect(1)
    assert n[1].role == Role.LEADER
    with pytest.raises(ProposalDropped, match="committed an entry of its term"):
        n[1].propose_conf_change(ConfChange(ADD_LEARNER, 4))


@pytest.mark.parametrize(
    "cc,msg",
    [
        (ConfChange(ADD_VOTER, 2), "already a voter"),
        (ConfChange(ADD_LEARNER, 2), "demoting"),
        (ConfChange(REMOVE, 7), "not a member"),
        (ConfChange(PROMOTE, 2), "not a learner"),
        (ConfChange(ADD_VOTER, 0), "invalid node id"),
        (ConfChange(42, 5), "unknown configuration change"),
    ],
)
def test_invalid_changes_raise(cc: ConfChange, msg: str) -> None:
    n = cluster()
    with pytest.raises(ConfChangeError, match=msg):
        n[1].propose_conf_change(cc)


def test_cannot_remove_last_voter() -> None:
    n = Network([1], CFG)
    n.elect(1)
    n.tick_all(1)
    with pytest.raises(ConfChangeError, match="last voter"):
        n[1].propose_conf_change(ConfChange(REMOVE, 1))


def test_add_voter_directly_and_new_node_learns_history() -> None:
    n = cluster()
    n.propose(1, b"before")
    n.add_node(4)
    change(n, 1, ADD_VOTER, 4)
    assert n[4].voters == (1, 2, 3, 4)
    assert n.nodes[4].applied_data() == [b"before"]


def test_conf_state_survives_restart() -> None:
    n = cluster()
    n.add_node(4)
    change(n, 1, ADD_LEARNER, 4)
    n.restart(2)
    assert n[2].learners == (4,) and n[2].voters == (1, 2, 3)
