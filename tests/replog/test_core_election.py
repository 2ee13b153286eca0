"""Elections: pre-vote, check-quorum, vote durability, split votes (notes §6.2 A3-A9)."""

from __future__ import annotations

import random

import pytest

from kvmesh.replog.core.raft import RaftCore
from kvmesh.replog.sim.harness import Network
from kvmesh.replog.storage.memory import MemoryStorage
from kvmesh.replog.types import (
    Append,
    AppendResp,
    Heartbeat,
    HeartbeatResp,
    NotLeader,
    PreVote,
    PreVoteResp,
    RaftConfig,
    ReadOnlyOption,
    Role,
    Vote,
    VoteResp,
)

PV_CQ = RaftConfig(election_tick=10, heartbeat_tick=1, pre_vote=True, check_quorum=True)
NO_PV = RaftConfig(election_tick=10, heartbeat_tick=1, pre_vote=False, check_quorum=False)


def cluster(ids=(1, 2, 3), cfg=PV_CQ, leader=1, seed=0) -> Network:
    n = Network(ids, cfg, seed=seed)
    n.elect(leader)
    assert n.leader() == leader
    return n


def test_a1_cold_start_elects_one_leader_by_ticks() -> None:
    n = Network([1, 2, 3], PV_CQ, seed=3)
    for _ in range(2 * 20):
        n.tick_all(1)
        if n.leaders():
            break
    assert len(n.leaders()) == 1
    lid = n.leader()
    idx = n.propose(lid, b"x")
    assert n[lid].log.committed == idx


def test_a4_prevote_keeps_isolated_follower_from_disrupting() -> None:
    """A4: a follower isolated for 10 x election_max does not raise its term (pre-vote), and
    when it returns the leader is undisturbed."""
    n = cluster()
    term = n[1].term
    n.isolate(3)
    n.tick_all(10 * 20)
    assert n[3].term == term
    assert n[3].role in (Role.FOLLOWER, Role.PRE_CANDIDATE)
    n.recover()
    n.tick_all(5)
    assert n.leader() == 1 and all(n[i].term == term for i in (1, 2, 3))


def test_a4_control_without_prevote_the_leader_is_deposed() -> None:
    """A4 control: without pre-vote the returning follower's inflated term deposes the
    leader (this is what pre-vote prevents)."""
    n = cluster(cfg=NO_PV)
    term = n[1].term
    n.isolate(3)
    n.tick_all(10 * 20)
    assert n[3].term > term + 3
    n.recover()
    n.tick_all(1)
    assert n[1].term > term
    assert n[1].role != Role.LEADER or n[1].term == n[3].term


def test_a5_isolated_leader_steps_down_within_one_election_timeout() -> None:
    """A5: check-quorum makes a minority leader step down; the majority elects a new one;
    proposals to the old leader are refused once it stepped down and never commit."""
    n = cluster()
    n.isolate(1)
    idx = n[1].propose(b"never-committed")
    for t in range(1, 2 * PV_CQ.election_tick + 1):  # noqa: B007 - t is read after the loop
        n.tick_all(1)
        if n[1].role != Role.LEADER:
            break
    assert n[1].role == Role.FOLLOWER
    assert t <= 2 * PV_CQ.election_tick  # first check-quorum window after the last ack
    with pytest.raises(NotLeader):
        n[1].propose(b"x")
    n.tick_all(3 * 20)
    new = n.leader()
    assert new in (2, 3)
    n.propose(new, b"after")
    n.recover()
    n.tick_all(10)
    assert all(b"never-committed" not in n.nodes[i].applied_data() for i in (1, 2, 3))
    assert (
        n[1].log.term(idx) != n[1].term
        or n[1].log.entries(idx, idx + 1)[0].data != b"never-committed"
    )


def test_a6_one_way_inbound_loss_deposes_leader() -> None:
    """A6: the leader's outbound links work but nothing reaches it: check-quorum makes it
    step down and a new leader is elected; safety holds."""
    n = cluster()
    for j in (2, 3):
        n.cut_one_way(j, 1)
    n.tick_all(3 * 20)
    assert n[1].role != Role.LEADER
    assert len(n.leaders()) == 1 and n.leader() in (2, 3)


def test_a7_non_transitive_partition_makes_progress() -> None:
    """A7: A-B and B-C up, A-C cut, leader A: the cluster keeps (or regains) a leader
    that commits; C may stay leaderless while A-B hold a quorum."""
    n = cluster(leader=1)
    n.cut(1, 3)
    n.tick_all(5 * 20)
    leaders = n.leaders()
    assert len(leaders) == 1
    lid = leaders[0]
    terms = {n[i].term for i in (1, 2, 3)}
    assert n[lid].term == max(terms)
    idx = n.propose(lid, b"progress")
    assert n[lid].log.committed >= idx


def test_a3_split_vote_resolves() -> None:
    """A3: two candidates split the vote in one term; a later round elects exactly one
    leader, never two in a term."""
    n = Network([1, 2, 3, 4], NO_PV, seed=1)
    n.cut(1, 3)
    n.cut(1, 4)
    n.cut(2, 3)
    n.cut(2, 4)
    n[1].campaign()
    n[3].campaign()
    n.stabilize()
    assert n[1].term == n[3].term and not n.leaders()
    n.recover()
    leaders_by_term: dict[int, set[int]] = {}
    for _ in range(3 * 20):
        n.tick_all(1)
        for i in n.leaders():
            leaders_by_term.setdefault(n[i].term, set()).add(i)
        if n.leaders():
            break
    assert len(n.leaders()) == 1
    assert all(len(v) == 1 for v in leaders_by_term.values())


def test_followers_ignore_votes_while_leader_alive() -> None:
    """Check-quorum lease on followers: a vote request with a higher term is ignored (term
    unchanged) while the follower heard from its leader within an election timeout."""
    n = cluster()
    term = n[2].term
    n[2].step(Vote(3, 2, term + 1, n[3].log.last_index(), n[3].log.last_term()))
    n.flush()
    assert n[2].term == term and n[2].vote == 1


def test_transfer_flag_bypasses_follower_lease() -> None:
    n = cluster()
    term = n[2].term
    n[2].step(Vote(3, 2, term + 1, n[3].log.last_index(), n[3].log.last_term(), transfer=True))
    msgs = n.nodes[2].process_ready()
    assert n[2].term == term + 1 and n[2].vote == 3
    assert any(type(m) is VoteResp and not m.reject for m in msgs)


def test_unknown_node_cannot_raise_terms() -> None:
    """D3 guard: vote requests from nodes outside the configuration are ignored."""
    n = Network([1, 2, 3], NO_PV)
    n.stabilize()
    n[2].step(Vote(9, 2, 50, 100, 50))
    n[2].step(PreVote(9, 2, 50, 100, 50))
    assert n[2].term == 1 and n[2].vote == 0


def test_prevote_does_not_change_voter_state() -> None:
    n = Network([1, 2, 3], PV_CQ)
    n.stabilize()
    c = n[2]
    term, vote = c.term, c.vote
    c.step(PreVote(3, 2, term + 1, c.log.last_index(), c.log.last_term()))
    msgs = n.nodes[2].process_ready()
    assert c.term == term and c.vote == vote
    resp = [m for m in msgs if type(m) is PreVoteResp]
    assert resp and not resp[0].reject and resp[0].term == term + 1


def test_prevote_rejected_for_stale_log() -> None:
    n = cluster(
        cfg=RaftConfig(election_tick=10, heartbeat_tick=1, pre_vote=True, check_quorum=False)
    )
    n.propose(1, b"x")
    c = n[2]
    c.step(PreVote(3, 2, c.term + 1, 1, 1))
    msgs = n.nodes[2].process_ready()
    assert [m.reject for m in msgs if type(m) is PreVoteResp] == [True]


def test_stale_leader_learns_term_from_rejection() -> None:
    n = cluster()
    n.isolate(1)
    n.tick_all(3 * 20)
    new = [i for i in n.leaders() if i != 1]
    assert new
    # Old leader (still in its old term if it had not stepped down) sends a heartbeat.
    n.recover()
    n[2].step(Heartbeat(1, 2, 1, commit=0, ctx=0))
    msgs = n.nodes[2].process_ready()
    assert any(type(m) is AppendResp and m.term == n[2].term for m in msgs)


# -- durability of votes and terms (A9, §4.3 rules 1-2) -----------------------------------


def _single(cfg=NO_PV, voters=(1, 2, 3)) -> tuple[RaftCore, MemoryStorage]:
    st = MemoryStorage.bootstrap(list(voters))
    core = RaftCore(1, st, cfg, random.Random(0))
    rd = core.ready()
    core.advance(rd)
    return core, st


def test_vote_response_only_after_persist() -> None:
    """A9 / rule 1: a granted vote is sent only after the hard state recording it."""
    core, st = _single()
    core.step(Vote(2, 1, 5, 10, 1))
    rd = core.ready()
    assert rd.hard_state is not None and rd.hard_state.term == 5 and rd.hard_state.vote == 2
    assert rd.must_sync
    assert not [m for m in rd.send_now if type(m) is VoteResp]
    assert [m for m in rd.send_after_persist if type(m) is VoteResp and not m.reject]


def test_campaign_messages_wait_for_persisted_term() -> None:
    """A candidate's vote requests carry a term that must be durable first."""
    core, st = _single()
    core.campaign()
    rd = core.ready()
    assert rd.hard_state.term == core.term and rd.hard_state.vote == 1
    assert not [m for m in rd.send_now if type(m) is Vote]
    assert len([m for m in rd.send_after_persist if type(m) is Vote]) == 2


def test_crash_before_persisting_vote_forgets_it() -> None:
    """A9: a node that crashes before its vote was persisted never sent it, so voting
    again in that term after restart is not a double vote."""
    core, st = _single()
    core.step(Vote(2, 1, 5, 10, 1))
    core.ready()  # the driver crashes before persisting this Ready
    restarted = RaftCore(1, st, NO_PV, random.Random(1))
    restarted.advance(restarted.ready())
    assert restarted.term == 1 and restarted.vote == 0
    restarted.step(Vote(3, 1, 5, 10, 1))
    rd2 = restarted.ready()
    assert rd2.hard_state.vote == 3


def test_crash_after_persisting_vote_remembers_it() -> None:
    """A9: after the vote is durable, a restarted node refuses a competing candidate."""
    core, st = _single()
    core.step(Vote(2, 1, 5, 10, 1))
    rd = core.ready()
    st.set_hard_state(rd.hard_state)
    restarted = RaftCore(1, st, NO_PV, random.Random(1))
    restarted.advance(restarted.ready())
    restarted.step(Vote(3, 1, 5, 10, 1))
    rd2 = restarted.ready()
    assert [m.reject for m in rd2.send_after_persist if type(m) is VoteResp] == [True]
    assert restarted.vote == 2


def test_leader_appends_go_out_before_its_own_fsync() -> None:
    """Thesis §10.2.1: the leader's Appends are "send now"; follower acknowledgements are
    "send after persist"."""
    n = cluster()
    n[1].propose(b"x")
    rd = n[1].ready()
    assert rd.entries_to_append and [m for m in rd.send_now if type(m) is Append]
    app = [m for m in rd.send_now if type(m) is Append and m.to == 2]
    n[1].advance(rd)
    n[2].step(app[0])
    rd2 = n[2].ready()
    assert rd2.entries_to_append
    assert not [m for m in rd2.send_now if type(m) is AppendResp]
    assert [m for m in rd2.send_after_persist if type(m) is AppendResp]
    n[2].advance(rd2)


def test_single_voter_commits_only_persisted_entries() -> None:
    """etcd #14370: a single-voter leader reports an entry committed only after a Ready
    that persisted it was advanced, never in the Ready that asks to persist it."""
    st = MemoryStorage.bootstrap([1])
    core = RaftCore(1, st, NO_PV, random.Random(0))
    core.advance(core.ready())
    core.campaign()
    while core.has_ready():
        rd = core.ready()
        st.append(rd.entries_to_append) if rd.entries_to_append else None
        st.set_hard_state(rd.hard_state) if rd.hard_state else None
        core.advance(rd)
    idx = core.propose(b"x")
    rd = core.ready()
    assert [e.index for e in rd.entries_to_append] == [idx]
    assert idx not in [e.index for e in rd.committed_entries]
    st.append(rd.entries_to_append)
    core.advance(rd)
    rd = core.ready()
    assert [e.data for e in rd.committed_entries] == [b"x"]
    core.advance(rd)


def test_heartbeat_response_does_not_wait_for_persistence() -> None:
    n = cluster()
    n[1].tick()
    n.flush()
    hb = [m for m in n.queue if type(m) is Heartbeat and m.to == 2][0]
    n.queue = []
    n[2].step(hb)
    rd = n[2].ready()
    assert [m for m in rd.send_now if type(m) is HeartbeatResp]
    n[2].advance(rd)


def test_restart_in_lease_mode_withholds_votes_for_one_timeout() -> None:
    """A restarted node may have vouched for a leader's lease before it crashed: in lease
    mode it grants no vote for one election timeout after booting."""
    cfg = RaftConfig(
        election_tick=10, heartbeat_tick=1, read_only_option=ReadOnlyOption.LEASE_BASED
    )
    n = Network([1, 2, 3], cfg)
    # Freshly booted nodes withhold votes too: the first election needs a timeout.
    n.elect(1)
    assert not n.leaders()
    for _ in range(3 * 20):
        n.tick_all(1)
        if n.leaders():
            break
    assert len(n.leaders()) == 1
    lead = n.leader()
    other = [i for i in (1, 2, 3) if i != lead]
    n.restart(other[0])
    c = n[other[0]]
    term = c.term
    c.step(
        Vote(other[1], c.id, term + 1, n[other[1]].log.last_index(), n[other[1]].log.last_term())
    )
    n.flush()
    assert c.term == term
    n.isolate(c.id)
    n.tick(c.id, cfg.election_tick)
    n.recover()
    c.step(
        Vote(other[1], c.id, term + 1, n[other[1]].log.last_index(), n[other[1]].log.last_term())
    )
    n.flush()
    assert c.term == term + 1 and c.vote == other[1]


def test_learner_never_campaigns() -> None:
    n = Network([1, 2, 3, 4], PV_CQ, voters=[1, 2, 3], learners=[4])
    n.stabilize()
    n.isolate(4)
    n.tick_all(10 * 20)
    assert n[4].role == Role.FOLLOWER and n[4].term == 1
    assert n[4].learners == (4,)


# Pre-vote tie-break (issue 16: a second election round after a leader crash; the
# distribution over seeds is tests/replog/test_sim_failover.py).


def _dead_leader(leader: int = 1, ids=(1, 2, 3)) -> Network:
    n = cluster(ids, leader=leader)
    n.isolate(leader)
    return n


def test_tied_pre_candidates_elect_the_lower_id_in_the_next_term() -> None:
    """Both followers of a dead leader pre-campaign at once with equal logs: before the
    tie-break each granted the other's pre-vote, both campaigned for the same term, each
    voted for itself and the vote split. Now exactly one (the lower id) goes on."""
    n = _dead_leader()
    term = n[2].term
    n[3].campaign()
    n[2].campaign()
    n.stabilize()
    assert n[2].role == Role.LEADER and n[2].term == term + 1
    assert n[3].role == Role.FOLLOWER and n[3].lead == 2 and n[3].term == term + 1


def test_more_up_to_date_pre_candidate_wins_regardless_of_id() -> None:
    n = cluster()
    n.cut(1, 2)  # 2 misses the last entry: 3's log is ahead
    n.propose(1, b"x")
    n.isolate(1)
    assert n[3].log.last_index() > n[2].log.last_index()
    term = n[2].term
    n[2].campaign()
    n[3].campaign()
    n.stabilize()
    assert n[3].role == Role.LEADER and n[3].term == term + 1


def test_pre_candidate_gives_way_once_per_term() -> None:
    """A pre-candidate that hears nobody (its inbound links cut) sends pre-votes every
    tick and can never win: the others give way to it once per term, then campaign on."""
    n = _dead_leader(ids=(1, 2, 3, 4, 5))
    for i in (3, 4, 5):
        n.cut_one_way(i, 2)
    term = n[3].term
    winners = []
    for _ in range(100):
        n.tick_all(1)
        winners = [i for i in (3, 4, 5) if n[i].role == Role.LEADER]
        if winners:
            break
    assert winners and n[winners[0]].term > term
    assert n[2].role == Role.PRE_CANDIDATE


def test_pre_vote_grant_holds_the_followers_own_campaign_off_once() -> None:
    """A follower that granted a pre-vote does not start its own campaign for one election
    timeout (once per term): in a 5-voter cluster one that did took the other followers'
    votes and split the election."""
    n = _dead_leader(ids=(1, 2, 3, 4, 5))
    for i in (2, 3, 4, 5):
        n.tick(i, 10)  # out of the lease of the dead leader
    f = n[3]
    f.randomized_election_timeout = f.election_elapsed + 1
    n.ignore(PreVoteResp)  # 2's pre-campaign never completes
    n[2].campaign()
    n.stabilize()
    before = f.election_elapsed
    assert f.randomized_election_timeout >= before + 10
    # A second pre-vote in the same term does not postpone again.
    timeout = f.randomized_election_timeout
    n[2].campaign()
    n.stabilize()
    assert f.randomized_election_timeout == timeout
