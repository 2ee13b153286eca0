"""One test per rule of the Raft paper (Ongaro & Ousterhout, "In Search of an
Understandable Consensus Algorithm", §5), after etcd-raft's raft_paper_test.go."""

from __future__ import annotations

import random

import pytest

from kvmesh.replog.core.raft import RaftCore
from kvmesh.replog.sim.harness import Network
from kvmesh.replog.storage.memory import MemoryStorage
from kvmesh.replog.types import (
    Append,
    AppendResp,
    Entry,
    HardState,
    Heartbeat,
    RaftConfig,
    Role,
    Vote,
    VoteResp,
    bootstrap_entries,
)

CFG = RaftConfig(election_tick=10, heartbeat_tick=1, pre_vote=False, check_quorum=False)


def make_core(
    node_id: int = 1,
    voters=(1, 2, 3),
    cfg: RaftConfig = CFG,
    entries: list[Entry] | None = None,
    term: int = 1,
    seed: int = 0,
) -> RaftCore:
    """A core over a bootstrapped storage whose log is the bootstrap prefix + ``entries``."""
    st = MemoryStorage.bootstrap(list(voters))
    if entries:
        st.append(entries)
    boot, hs = bootstrap_entries(list(voters))
    st.set_hard_state(HardState(term=max(term, 1), vote=0, commit=hs.commit))
    core = RaftCore(node_id, st, cfg, random.Random(seed))
    drain(core, st)  # apply the bootstrap configuration
    return core


def drain(core: RaftCore, st: MemoryStorage) -> list:
    """Persist and "apply" every Ready; returns all messages produced."""
    out = []
    while core.has_ready():
        rd = core.ready()
        if rd.snapshot_to_install is not None:
            st.apply_snapshot(rd.snapshot_to_install)
        if rd.entries_to_append:
            st.append(rd.entries_to_append)
        if rd.hard_state is not None:
            st.set_hard_state(rd.hard_state)
        out.extend(rd.send_now)
        out.extend(rd.send_after_persist)
        core.advance(rd)
    return out


def become_leader(core: RaftCore, voters=(2, 3)) -> list:
    """Campaign and receive votes from ``voters``; returns the messages sent after winning."""
    st = core.storage
    core.campaign()
    drain(core, st)
    for v in voters:
        core.step(VoteResp(v, core.id, core.term, reject=False))
    assert core.role == Role.LEADER
    return drain(core, st)


# -- §5.1: terms -------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["follower", "candidate", "leader"])
def test_update_term_from_message(role: str) -> None:
    """§5.1: a server seeing a larger term adopts it and reverts to follower."""
    core = make_core()
    if role == "candidate":
        core.campaign()
    elif role == "leader":
        become_leader(core)
    t = core.term
    core.step(Append(2, 1, t + 5, prev_index=0, prev_term=0, commit=0))
    assert core.term == t + 5
    assert core.role == Role.FOLLOWER
    assert core.lead == 2


def test_reject_stale_term_message() -> None:
    """§5.1: a request with a stale term is rejected (the log is untouched, the sender
    learns the newer term)."""
    core = make_core(term=3)
    last = core.log.last_index()
    core.step(
        Append(
            2,
            1,
            2,
            prev_index=last,
            prev_term=1,
            commit=last,
            entries=[Entry(2, last + 1, 0, b"x")],
        )
    )
    msgs = drain(core, core.storage)
    assert core.log.last_index() == last
    assert core.term == 3
    assert any(type(m) is AppendResp and m.term == 3 for m in msgs)


# -- §5.2: leader election ---------------------------------------------------------------


def test_start_as_follower() -> None:
    core = make_core()
    assert core.role == Role.FOLLOWER


def test_leader_broadcast_heartbeat() -> None:
    """§5.2: a leader sends heartbeats to every peer each heartbeat interval."""
    core = make_core()
    become_leader(core)
    core.tick()
    msgs = [m for m in drain(core, core.storage) if type(m) is Heartbeat]
    assert sorted(m.to for m in msgs) == [2, 3]
    assert all(m.term == core.term for m in msgs)


@pytest.mark.parametrize("start_role", ["follower", "candidate"])
def test_nonleader_start_election(start_role: str) -> None:
    """§5.2: on election timeout a follower (or candidate) increments its term, votes for
    itself and asks every peer for votes."""
    core = make_core()
    if start_role == "candidate":
        core.campaign()
        drain(core, core.storage)
    t = core.term
    for _ in range(2 * CFG.election_tick):
        core.tick()
    msgs = drain(core, core.storage)
    assert core.term == t + 1
    assert core.role == Role.CANDIDATE
    assert core.vote == 1
    # Every peer asked, in the new term; unanswered requests are repeated each heartbeat
    # interval (§5.1: "servers retry RPCs if they do not receive a response in a timely
    # manner").
    votes = {(m.to, m.term) for m in msgs if type(m) is Vote}
    assert votes == {(2, t + 1), (3, t + 1)}


@pytest.mark.parametrize(
    "size,votes,expected",
    [
        (1, {}, Role.LEADER),
        (3, {2: True, 3: True}, Role.LEADER),
        (3, {2: True}, Role.LEADER),
        (5, {2: True, 3: True, 4: True, 5: True}, Role.LEADER),
        (5, {2: True, 3: True}, Role.LEADER),
        (3, {2: False, 3: False}, Role.FOLLOWER),
        (5, {2: False, 3: False, 4: False}, Role.FOLLOWER),
        (3, {}, Role.CANDIDATE),
        (5, {2: True}, Role.CANDIDATE),
        (5, {2: False, 3: False}, Role.CANDIDATE),
    ],
)
def test_leader_election_in_one_round(size: int, votes: dict[int, bool], expected: Role) -> None:
    """§5.2: a candidate wins with a majority, loses with a majority of rejections,
    otherwise keeps waiting."""
    core = make_core(voters=tuple(range(1, size + 1)))
    core.campaign()
    drain(core, core.storage)
    for v, granted in votes.items():
        core.step(VoteResp(v, 1, core.term, reject=not granted))
    assert core.role == expected


def test_follower_votes_once_per_term() -> None:
    """§5.2: each server votes for at most one candidate per term, first come first
    served; a repeated request from the same candidate is granted again."""
    core = make_core()
    li, lt = core.log.last_index(), core.log.last_term()
    core.step(Vote(2, 1, 5, li, lt))
    core.step(Vote(3, 1, 5, li, lt))
    core.step(Vote(2, 1, 5, li, lt))
    resps = [m for m in drain(core, core.storage) if type(m) is VoteResp]
    assert [(m.to, m.reject) for m in resps] == [(2, False), (3, True), (2, False)]
    assert core.storage.hard_state.vote == 2


def test_candidate_falls_back_to_follower() -> None:
    """§5.2: a candidate receiving AppendEntries from a leader of at least its term
    becomes a follower."""
    core = make_core()
    core.campaign()
    drain(core, core.storage)
    t = core.term
    core.step(
        Append(2, 1, t, prev_index=core.log.last_index(), prev_term=core.log.last_term(), commit=0)
    )
    assert core.role == Role.FOLLOWER and core.lead == 2 and core.term == t


def test_election_timeout_randomized() -> None:
    """§5.2: election timeouts are drawn from [election_tick, 2 * election_tick)."""
    seen = set()
    core = make_core(seed=7)
    for _ in range(200):
        core._become_follower(core.term + 1, 0)
        seen.add(core.randomized_election_timeout)
    assert min(seen) >= CFG.election_tick and max(seen) < 2 * CFG.election_tick
    assert len(seen) > CFG.election_tick // 2


# -- §5.3: log replication -----------------------------------------------------------------


def test_leader_start_replication() -> None:
    """§5.3: a proposal is appended to the leader's log and sent to every follower after
    the previous entry."""
    core = make_core()
    become_leader(core)
    li = core.log.last_index()
    for v in (2, 3):  # followers confirm the no-op: the leader leaves probe state
        core.step(AppendResp(v, 1, core.term, index=li))
    drain(core, core.storage)
    idx = core.propose(b"some data")
    assert idx == li + 1
    msgs = [m for m in drain(core, core.storage) if type(m) is Append]
    assert sorted(m.to for m in msgs) == [2, 3]
    for m in msgs:
        assert m.entries and m.entries[-1].data == b"some data" and m.entries[-1].index == idx
        assert m.prev_index + len(m.entries) == idx


def test_leader_commit_entry_and_notify() -> None:
    """§5.3: once a majority stored an entry the leader commits and applies it, and
    followers learn the new commit index."""
    n = Network([1, 2, 3], CFG)
    n.elect(1)
    idx = n.propose(1, b"x")
    assert n[1].log.committed == idx and n.nodes[1].applied_data() == [b"x"]
    # Followers learn the commit index with the next Append or heartbeat.
    n.tick(1)
    n.stabilize()
    for i in (1, 2, 3):
        assert n[i].log.committed == idx
        assert n.nodes[i].applied_data() == [b"x"]


@pytest.mark.parametrize(
    "size,acks,committed",
    [
        (1, set(), True),
        (3, set(), False),
        (3, {2}, True),
        (3, {2, 3}, True),
        (5, set(), False),
        (5, {2}, False),
        (5, {2, 3}, True),
        (5, {2, 3, 4, 5}, True),
    ],
)
def test_leader_acknowledge_commit(size: int, acks: set[int], committed: bool) -> None:
    """§5.3: an entry is committed once the leader and a majority stored it."""
    voters = tuple(range(1, size + 1))
    core = make_core(voters=voters)
    if size == 1:
        core.campaign()
        drain(core, core.storage)
    else:
        become_leader(core, voters=voters[1 : size // 2 + 1])
        # Let followers confirm the no-op so that only the new entry is pending.
        for v in voters[1:]:
            core.step(AppendResp(v, 1, core.term, index=core.log.last_index()))
        drain(core, core.storage)
    idx = core.propose(b"x")
    drain(core, core.storage)
    for v in acks:
        core.step(AppendResp(v, 1, core.term, index=idx))
    drain(core, core.storage)
    assert (core.log.committed >= idx) == committed


def test_leader_commit_preceding_entries() -> None:
    """§5.3: committing an entry commits all preceding ones, including earlier terms'."""
    old = [Entry(1, 4, 0, b"a"), Entry(1, 5, 0, b"b")]
    n = Network([1, 2, 3], CFG)
    for i in (1, 2):
        n.nodes[i].storage.append(old)
    n.restart(1)
    n.restart(2)
    n.elect(1)
    n.propose(1, b"c")
    n.tick(1)
    n.stabilize()
    assert n.nodes[3].applied_data() == [b"a", b"b", b"c"]


def test_follower_commit_entry() -> None:
    """§5.3: a follower applies entries once it learns they are committed."""
    core = make_core()
    li = core.log.last_index()
    ents = [Entry(1, li + 1, 0, b"a"), Entry(1, li + 2, 0, b"b")]
    core.step(Append(2, 1, 1, prev_index=li, prev_term=1, commit=li + 1, entries=ents))
    applied = []
    while core.has_ready():
        rd = core.ready()
        core.storage.append(rd.entries_to_append) if rd.entries_to_append else None
        applied += [e.data for e in rd.committed_entries]
        core.advance(rd)
    assert core.log.committed == li + 1
    assert applied == [b"a"]


@pytest.mark.parametrize(
    "prev_term,prev_index,rejected", [(1, 5, False), (1, 4, False), (2, 5, True), (1, 7, True)]
)
def test_follower_check_append(prev_term: int, prev_index: int, rejected: bool) -> None:
    """§5.3: a follower refuses entries whose predecessor (index, term) it lacks."""
    core = make_core(entries=[Entry(1, 4, 0, b"a"), Entry(1, 5, 0, b"b")])  # commit 3
    core.step(
        Append(
            2,
            1,
            2,
            prev_index=prev_index,
            prev_term=prev_term,
            commit=0,
            entries=[Entry(2, prev_index + 1, 0, b"x")],
        )
    )
    resp = [m for m in drain(core, core.storage) if type(m) is AppendResp][-1]
    assert resp.reject == rejected
    if rejected:
        assert resp.index == prev_index
        # hint points at or below the rejected index, at a term <= prev_term
        assert resp.hint_index <= prev_index and resp.hint_term <= prev_term


def test_follower_append_entries_truncates_conflicts() -> None:
    """§5.3: a conflicting suffix is deleted and replaced by the leader's entries."""
    core = make_core(
        entries=[Entry(1, 4, 0, b"a"), Entry(2, 5, 0, b"b"), Entry(2, 6, 0, b"c")], term=2
    )
    core.step(
        Append(
            2,
            1,
            3,
            prev_index=4,
            prev_term=1,
            commit=3,
            entries=[Entry(3, 5, 0, b"B"), Entry(3, 6, 0, b"C"), Entry(3, 7, 0, b"D")],
        )
    )
    drain(core, core.storage)
    st = core.storage
    assert [(e.term, e.data) for e in st.entries(4, 8)] == [
        (1, b"a"),
        (3, b"B"),
        (3, b"C"),
        (3, b"D"),
    ]


FIG7_LEADER_TERMS = [1, 1, 1, 4, 4, 5, 5, 6, 6, 6]
FIG7_FOLLOWERS = {
    "a": [1, 1, 1, 4, 4, 5, 5, 6, 6],
    "b": [1, 1, 1, 4],
    "c": [1, 1, 1, 4, 4, 5, 5, 6, 6, 6, 6],
    "d": [1, 1, 1, 4, 4, 5, 5, 6, 6, 6, 7, 7],
    "e": [1, 1, 1, 4, 4, 4, 4],
    "f": [1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3],
}


def _storage_with_terms(terms: list[int], voters: list[int], term: int) -> MemoryStorage:
    boot, hs = bootstrap_entries(voters)
    st = MemoryStorage()
    # Shift the figure's logs after the 3 bootstrap entries (which all logs share).
    ents = list(boot) + [
        Entry(t, len(boot) + i, 0, b"e%d-%d" % (i, t))
        for i, t in enumerate(terms[len(boot) - 0 :], start=1)
    ]
    st.append(ents)
    st.set_hard_state(HardState(term=term, vote=0, commit=hs.commit))
    return st


@pytest.mark.parametrize("name", sorted(FIG7_FOLLOWERS))
def test_leader_sync_follower_log(name: str) -> None:
    """§5.3 / Figure 7: whatever the follower's log (missing, extra or conflicting
    entries), the leader makes it identical to its own."""
    voters = [1, 2, 3]
    leader_st = _storage_with_terms(FIG7_LEADER_TERMS, voters, 8)
    follower_st = _storage_with_terms(FIG7_FOLLOWERS[name], voters, 8)
    # Node 3 votes for the leader but does not take part otherwise.
    n = Network(
        [1, 2, 3],
        CFG,
        storages={
            1: leader_st,
            2: follower_st,
            3: _storage_with_terms(FIG7_LEADER_TERMS, voters, 8),
        },
    )
    n.cut(2, 3)
    n.elect(1)
    assert n.leader() == 1
    n.propose(1, b"new")
    leader_log = [(e.term, e.data) for e in leader_st.all_entries()]
    follower_log = [(e.term, e.data) for e in follower_st.all_entries()]
    assert follower_log == leader_log


# -- §5.4: safety --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cand_last_term,cand_last_index,granted",
    [
        (1, 2, False),  # same last term, shorter log
        (1, 3, False),  # voter has term 2 at index 4: voter is more up to date
        (2, 3, False),
        (2, 4, True),  # identical
        (2, 5, True),  # longer
        (3, 2, True),  # higher last term wins regardless of length
    ],
)
def test_voter_rejects_less_up_to_date(
    cand_last_term: int, cand_last_index: int, granted: bool
) -> None:
    """§5.4.1: a vote is denied to a candidate whose log is less up-to-date."""
    core = make_core(entries=[Entry(2, 4, 0, b"x")], term=2)
    core.step(Vote(2, 1, 5, cand_last_index, cand_last_term))
    resp = [m for m in drain(core, core.storage) if type(m) is VoteResp][-1]
    assert resp.reject == (not granted)


def test_leader_only_commits_current_term_by_counting() -> None:
    """§5.4.2: a leader never commits an earlier-term entry by counting replicas; it
    becomes committed only with a current-term entry after it."""
    core = make_core(entries=[Entry(2, 4, 0, b"old")], term=2)
    become_leader(core)  # term 3, no-op at index 5
    assert core.term == 3
    # Both followers store the old entry (index 4) but not the no-op.
    core.step(AppendResp(2, 1, 3, index=4))
    core.step(AppendResp(3, 1, 3, index=4))
    drain(core, core.storage)
    assert core.log.committed == 3  # index 4 (term 2) is replicated everywhere, not committed
    core.step(AppendResp(2, 1, 3, index=5))
    drain(core, core.storage)
    assert core.log.committed == 5


def test_figure8_scenario() -> None:
    """Figure 8: S1 replicates an entry of its term to S2 only and crashes; S5 wins the
    next term and writes entries nobody else receives; S1 returns, wins a later term and
    replicates its old entry to a majority: it is committed only together with an entry of
    S1's current term, after which S5 can no longer overwrite it."""
    n = Network([1, 2, 3, 4, 5], CFG)
    n.elect(1)
    base = n[1].log.last_index()
    # (a) S1 appends at base+1; only S2 receives it.
    for j in (3, 4, 5):
        n.cut(1, j)
    n[1].propose(b"s1-old")
    n.stabilize()
    assert n[2].log.last_index() == base + 1 and n[1].log.committed == base
    # S1 crashes.
    n.recover()
    n.restart(1)
    n.isolate(1)
    # (b) S5 wins the next term with S3 and S4 but its Appends are lost.
    n.add_filter(lambda m: not (type(m) is Append and m.frm == 5))
    n.elect(5)
    assert n[5].role == Role.LEADER
    n[5].propose(b"s5-entry")
    n.stabilize()
    assert n[3].log.last_index() == base and n[5].log.last_index() == base + 2
    # (c) S5 is down; S1 returns and wins a later term with S2, S3, S4.
    n.recover()
    n.isolate(5)
    for _ in range(3):
        if n[1].role != Role.LEADER:
            n.elect(1)
    assert n[1].role == Role.LEADER and n[1].term > n[5].term
    e = n[1].log.entries(base + 1, base + 2)[0]
    assert e.data == b"s1-old" and e.term < n[1].term
    # Committed together with S1's no-op of the current term, which follows it.
    assert n[1].log.committed >= base + 2
    assert n[1].log.term(base + 2) == n[1].term
    # (d) S5 comes back: it cannot win, and its entries are replaced.
    n.recover()
    n.tick_all(50)
    assert n.leader() != 5
    for i in (1, 2, 3, 4, 5):
        assert n[i].log.entries(base + 1, base + 2)[0].data == b"s1-old"
        assert b"s5-entry" not in n.nodes[i].applied_data()
