"""Hostile messages at the core (issue 7, defects 1 and 3): ``step()`` validates every
message against the receiver's state and drops malformed or forged ones without raising,
and without moving terms, leadership or commit/match indexes."""

from __future__ import annotations

import random

from kvmesh.replog.sim.harness import Network
from kvmesh.replog.types import (
    MESSAGE_TYPES,
    Append,
    AppendResp,
    ConfState,
    Entry,
    EntryKind,
    Heartbeat,
    HeartbeatResp,
    InstallSnapshot,
    InstallSnapshotResp,
    PreVote,
    PreVoteResp,
    RaftConfig,
    ReadIndex,
    ReadIndexResp,
    Role,
    Snapshot,
    SnapshotMeta,
    TimeoutNow,
    Vote,
    VoteResp,
)

PV_CQ = RaftConfig(election_tick=10, heartbeat_tick=1, pre_vote=True, check_quorum=True)


def cluster(ids=(1, 2, 3), leader=1) -> Network:
    n = Network(ids, PV_CQ, seed=7)
    n.elect(leader)
    assert n.leader() == leader
    for k in range(5):
        n.propose(leader, b"v%d" % k)
    return n


def commit_everywhere(n: Network, data: bytes) -> int:
    """Propose on the leader; after one heartbeat every node has it committed."""
    idx = n.propose(n.leader(), data)
    n.tick_all(1)
    assert all(n[i].log.committed == idx and n[i].log.last_index() == idx for i in n.nodes)
    return idx


def snapshot_state(n: Network, i: int):
    c = n[i]
    return (c.term, c.vote, c.role, c.lead, c.log.committed, c.log.last_index())


def test_gap_append_is_dropped_and_the_follower_keeps_working() -> None:
    """Defect 3: entries that do not start at prev_index + 1 used to reach storage and kill
    the receiver ("append would leave a gap")."""
    n = cluster()
    f = n[2]
    last, term = f.log.last_index(), f.term
    f.step(
        Append(
            1, 2, term, last, f.log.last_term(), f.log.committed, [Entry(term, last + 3, 0, b"x")]
        )
    )
    n.nodes[2].process_ready()  # used to raise StorageError
    assert f.log.last_index() == last and f.dropped_msgs == 1
    commit_everywhere(n, b"after")


def test_non_contiguous_decreasing_or_future_term_entries_are_dropped() -> None:
    n = cluster()
    f = n[2]
    last, lt, term, commit = f.log.last_index(), f.log.last_term(), f.term, f.log.committed
    bad = [
        [Entry(term, last + 1), Entry(term, last + 3)],  # hole inside the batch
        [Entry(term, last + 1), Entry(term, last + 1)],  # repeated index
        [Entry(term, last + 1), Entry(term - 1, last + 2)],  # term goes down
        [Entry(term + 5, last + 1)],  # entry from a term after the sender's
        [Entry(lt - 1, last + 1)] if lt > 0 else [Entry(term, last)],  # below prev_term
        [Entry(term, last + 1, 7, b"")],  # unknown entry kind
        [Entry(term, last + 1, int(EntryKind.CONF_CHANGE), b"\xc1garbage")],  # undecodable
    ]
    for ents in bad:
        f.step(Append(1, 2, term, last, lt, commit, ents))
        assert n.nodes[2].process_ready() == []
    assert f.log.last_index() == last and f.dropped_msgs == len(bad)
    assert f.log.committed == commit
    commit_everywhere(n, b"after")


def test_append_resp_beyond_the_leaders_log_is_dropped() -> None:
    """Defect 1: an acknowledgement for an index the leader never had used to become the
    peer's match index."""
    n = cluster()
    ld = n[1]
    last, term = ld.log.last_index(), ld.term
    ld.step(AppendResp(2, 1, term, index=last + 1000))
    ld.step(
        AppendResp(3, 1, term, index=last + 1, reject=True, hint_index=last + 1, hint_term=term)
    )
    ld.step(AppendResp(3, 1, term, index=last, reject=True, hint_index=-4, hint_term=0))
    ld.step(InstallSnapshotResp(2, 1, term, index=last + 50))
    n.flush()
    st = ld.status()
    assert st.progress[2].match <= last and st.progress[3].match <= last
    assert st.progress[2].next <= last + 1 and st.progress[3].next <= last + 1
    assert ld.dropped_msgs == 4
    commit_everywhere(n, b"after")


def test_forged_transfer_vote_cannot_raise_terms() -> None:
    """Defect 3: Vote(transfer=True) bypassed the follower lease at any term (term 2 -> 1003
    with one message). A transfer vote is only honoured at the next term of the leader the
    receiver follows."""
    n = cluster()
    f = n[2]
    before = snapshot_state(n, 2)
    f.step(Vote(3, 2, f.term + 1000, f.log.last_index() + 10, f.term + 1000, transfer=True))
    f.step(PreVote(3, 2, f.term + 1000, f.log.last_index() + 10, f.term, transfer=True))
    n.flush()
    assert snapshot_state(n, 2) == before
    assert n.leader() == 1 and n[1].term == before[0]


def test_forged_timeout_now_has_no_effect() -> None:
    """Defect 3: a TimeoutNow made its receiver campaign whoever sent it, in any term."""
    n = cluster()
    term = n[1].term
    for m in (
        TimeoutNow(3, 2, term),  # a member that is not the leader
        TimeoutNow(9, 2, term),  # not a member at all
        TimeoutNow(1, 2, term + 7),  # the leader's id with a term it does not have
        TimeoutNow(0, 2, term),  # no node
    ):
        n[2].step(m)
        n.stabilize()
        assert n.leader() == 1 and all(n[i].term == term for i in (1, 2, 3)), m
    assert n[2].dropped_msgs == 4
    # The legitimate path still works: the leader hands over to 2.
    n[1].transfer_leader(2)
    n.stabilize()
    assert n.leader() == 2 and n[2].term == term + 1


def test_forged_vote_from_non_member_and_stale_fields_are_ignored() -> None:
    n = cluster()
    before = snapshot_state(n, 3)
    n[3].step(Vote(9, 3, before[0] + 1, 10**6, before[0] + 1, transfer=True))
    n[3].step(Vote(2, 3, before[0], -1, -1))
    n.flush()
    assert snapshot_state(n, 3) == before


def test_malformed_install_snapshot_is_dropped() -> None:
    n = cluster()
    f = n[2]
    term = f.term
    good_cs = ConfState((1, 2, 3))
    bad = [
        Snapshot(SnapshotMeta(100, term + 1, good_cs), b""),  # term after the sender's
        Snapshot(SnapshotMeta(100, 0, good_cs), b""),  # no term
        Snapshot(SnapshotMeta(100, term, ConfState(())), b""),  # no voters
        Snapshot(SnapshotMeta(100, term, ConfState((1, 2), (2,))), b""),  # voter and learner
        Snapshot(SnapshotMeta(100, term, ConfState((1, -2))), b""),  # bad id
    ]
    before = snapshot_state(n, 2)
    for s in bad:
        f.step(InstallSnapshot(1, 2, term, s))
    assert n.nodes[2].process_ready() == [] and n.nodes[2].installed == []
    assert snapshot_state(n, 2) == before and f.dropped_msgs == len(bad)


def test_read_index_resp_only_from_the_leader() -> None:
    n = cluster()
    f = n[2]
    f.step(ReadIndexResp(3, 2, f.term, 10**9, b"ctx"))
    n.nodes[2].process_ready()
    assert n.nodes[2].read_states == []


def _random_message(rng: random.Random, to: int, n: Network):
    mt = rng.choice(MESSAGE_TYPES)
    t = n[to].term
    frm = rng.choice([0, 1, 2, 3, 9, -1])
    term = rng.choice([t - 1, t, t, t + 1, t + 500, -3])
    last = n[to].log.last_index()

    def idx():
        return rng.choice([-2, 0, 1, last - 1, last, last + 1, last + 40])

    def ents():
        base = idx()
        out = []
        for k in range(rng.randrange(0, 4)):
            out.append(
                Entry(
                    rng.choice([t, t + 1, 1, 0]),
                    base + k + rng.choice([1, 1, 2, 0]),
                    rng.choice([0, 0, 1, 5]),
                    rng.choice([b"", b"x", b"\x93\x00\x04\xc4\x00"]),
                )
            )
        return out

    if mt is Append:
        return Append(frm, to, term, idx(), rng.choice([0, 1, t, t + 9]), idx(), ents())
    if mt is AppendResp:
        return AppendResp(
            frm, to, term, idx(), rng.random() < 0.5, idx(), rng.choice([-1, 0, t, t + 3])
        )
    if mt in (Vote, PreVote):
        return mt(frm, to, term, idx(), rng.choice([0, t, t + 9]), rng.random() < 0.5)
    if mt in (VoteResp, PreVoteResp):
        return mt(frm, to, term, rng.random() < 0.5)
    if mt is Heartbeat:
        return Heartbeat(frm, to, term, idx(), rng.choice([0, 1, 10**6, -1]))
    if mt is HeartbeatResp:
        return HeartbeatResp(frm, to, term, rng.choice([0, 1, 10**6, -1]))
    if mt is InstallSnapshot:
        cs = rng.choice([ConfState((1, 2, 3)), ConfState(()), ConfState((1, 9), (9,))])
        return InstallSnapshot(
            frm, to, term, Snapshot(SnapshotMeta(idx(), rng.choice([0, t, t + 2]), cs), b"junk")
        )
    if mt is InstallSnapshotResp:
        return InstallSnapshotResp(frm, to, term, idx())
    if mt is TimeoutNow:
        return TimeoutNow(frm, to, term)
    if mt is ReadIndex:
        return ReadIndex(frm, to, term, b"c")
    return ReadIndexResp(frm, to, term, idx(), b"c")


def test_random_hostile_messages_never_raise_and_the_cluster_keeps_committing() -> None:
    """Thousands of random, mostly malformed messages from members and strangers: no step
    or Ready raises, and afterwards the cluster elects a leader and commits on every node."""
    rng = random.Random(20261130)
    n = cluster()
    for _round in range(40):
        for _ in range(50):
            to = rng.choice([1, 2, 3])
            n[to].step(_random_message(rng, to, n))
            n.nodes[to].process_ready()  # drop the answers: the attacker does not read them
        n.queue = []
        n.tick_all(1)
    for _ in range(200):
        n.tick_all(1)
        if (
            len(n.leaders()) == 1
            and n[n.leader()].log.zero_term(n[n.leader()].log.committed) == n[n.leader()].term
        ):
            break
    lid = n.leader()
    idx = n.propose(lid, b"final")
    n.tick_all(3)
    assert all(n[i].log.committed >= idx for i in (1, 2, 3))
    assert all(n[i].role in (Role.FOLLOWER, Role.LEADER) for i in (1, 2, 3))
