"""Replication: flow control (B7, B8), fast back-off, snapshots (B5), compaction, the
Ready/advance contract and its races."""

from __future__ import annotations

import random

import pytest

from kvmesh.replog.core.progress import PROBE, REPLICATE, SNAPSHOT
from kvmesh.replog.core.raft import RaftCore
from kvmesh.replog.sim.harness import Network
from kvmesh.replog.storage.memory import MemoryStorage
from kvmesh.replog.types import (
    ENTRY_OVERHEAD,
    Append,
    AppendResp,
    Entry,
    HardState,
    InstallSnapshot,
    ProposalDropped,
    ProposalTooLarge,
    RaftConfig,
    ReadyContractError,
    Role,
    entry_size,
)

CFG = RaftConfig(election_tick=10, heartbeat_tick=1)


def cluster(cfg: RaftConfig = CFG, ids=(1, 2, 3)) -> Network:
    n = Network(ids, cfg)
    n.elect(1)
    assert n.leader() == 1
    return n


def settle(n: Network, ticks: int = 3) -> None:
    n.tick_all(ticks)


def test_pipelined_batches_commit_everywhere() -> None:
    n = cluster()
    for i in range(200):
        n[1].propose(b"p%d" % i)
    n.stabilize()
    settle(n)
    for i in (1, 2, 3):
        assert n.nodes[i].applied_data() == [b"p%d" % k for k in range(200)]


def test_proposals_between_readies_share_one_append() -> None:
    """Batching: proposals made before the next Ready go out in one Append per follower."""
    n = cluster()
    settle(n)
    for i in range(50):
        n[1].propose(b"x%d" % i)
    rd = n[1].ready()
    apps = [m for m in rd.send_now if type(m) is Append]
    assert sorted(m.to for m in apps) == [2, 3]
    assert all(len(m.entries) == 50 for m in apps)
    n[1].advance(rd)


def test_b8_large_entry_sent_alone_and_no_message_over_cap() -> None:
    cap = 1000
    cfg = RaftConfig(election_tick=10, heartbeat_tick=1, max_size_per_msg=cap)
    n = cluster(cfg)
    settle(n)
    sizes = [10, 20, cap - ENTRY_OVERHEAD, 30, 500, 500, 15]
    for k, sz in enumerate(sizes):
        n[1].propose(bytes([k]) * sz)
    delivered = n.stabilize()
    settle(n)
    apps = [m for m in delivered if type(m) is Append and m.entries]
    for m in apps:
        assert sum(entry_size(e) for e in m.entries) <= cap
    big = [m for m in apps if any(len(e.data) == cap - ENTRY_OVERHEAD for e in m.entries)]
    assert big and all(len(m.entries) == 1 for m in big)
    with pytest.raises(ProposalTooLarge):
        n[1].propose(b"z" * cap)
    assert n.nodes[3].applied_data() == [bytes([k]) * sz for k, sz in enumerate(sizes)]


def test_b7_uncommitted_bytes_limit_rejects_fast_then_recovers() -> None:
    cfg = RaftConfig(election_tick=10, heartbeat_tick=1, max_uncommitted_bytes=1000)
    n = cluster(cfg)
    settle(n)
    n.isolate(1)  # nothing commits
    accepted = 0
    with pytest.raises(ProposalDropped):
        for _ in range(100):
            n[1].propose(b"y" * 84)
            accepted += 1
    assert 0 < accepted <= 1000 // (84 + ENTRY_OVERHEAD) + 1
    assert n[1].uncommitted_size <= 1000 + 100
    n.recover()
    n.stabilize()
    settle(n)
    assert n[1].uncommitted_size == 0
    n[1].propose(b"y" * 84)


def test_inflight_window_bounds_messages_in_flight() -> None:
    cfg = RaftConfig(election_tick=10, heartbeat_tick=1, max_inflight_msgs=3, max_size_per_msg=200)
    n = cluster(cfg)
    settle(n)
    for i in range(40):
        n[1].propose(b"%03d" % i + b"." * 80)
    n.flush()
    to2 = [m for m in n.queue if type(m) is Append and m.to == 2 and m.entries]
    assert len(to2) == 3  # the window is full; the rest waits for acknowledgements
    assert n[1].prs[2].state == REPLICATE and n[1].prs[2].is_paused()
    n.stabilize()
    settle(n)
    assert len(n.nodes[2].applied_data()) == 40


def test_probe_state_sends_one_append_until_answered() -> None:
    n = cluster()
    settle(n)
    n.isolate(3)
    n[1].report_unreachable(3)
    assert n[1].prs[3].state == PROBE
    for i in range(5):
        n[1].propose(b"q%d" % i)
    n.flush()
    to3 = [m for m in n.queue if type(m) is Append and m.to == 3]
    assert len(to3) <= 1
    n.recover()
    n.stabilize()
    settle(n)
    assert n[1].prs[3].state == REPLICATE
    assert n.nodes[3].applied_data()[-5:] == [b"q%d" % i for i in range(5)]


def test_lost_append_in_replicate_state_is_recovered_by_heartbeats() -> None:
    n = cluster()
    settle(n)
    dropped = []

    def drop_first_to_2(m) -> bool:
        if type(m) is Append and m.to == 2 and m.entries and not dropped:
            dropped.append(m)
            return False
        return True

    n.add_filter(drop_first_to_2)
    n.propose(1, b"lost-once")
    assert dropped
    assert n[2].log.last_index() < n[1].log.last_index()
    settle(n, 4)
    assert n[2].log.last_index() == n[1].log.last_index()


def test_fast_backtracking_uses_few_round_trips() -> None:
    """A follower with a long divergent tail: the reject hint skips whole terms."""
    st_leader = MemoryStorage.bootstrap([1, 2, 3])
    st_follower = MemoryStorage.bootstrap([1, 2, 3])
    # Follower holds 300 entries of term 2 that the leader never had.
    st_follower.append([Entry(2, i, 0, b"f%d" % i) for i in range(4, 304)])
    st_follower.set_hard_state(HardState(term=2, vote=0, commit=3))
    st_leader.append([Entry(3, i, 0, b"l%d" % i) for i in range(4, 8)])
    st_leader.set_hard_state(HardState(term=3, vote=0, commit=3))
    n = Network(
        [1, 2, 3],
        CFG,
        storages={1: st_leader, 2: st_follower, 3: MemoryStorage.bootstrap([1, 2, 3])},
    )
    n.cut(2, 3)
    n.elect(1)
    assert n.leader() == 1
    rejects = [m for m in n.delivered if type(m) is AppendResp and m.frm == 2 and m.reject]
    assert len(rejects) <= 2
    assert [e.data for e in st_follower.all_entries()[3:7]] == [b"l4", b"l5", b"l6", b"l7"]
    assert st_follower.last_index() == n[1].log.last_index()


def test_b5_follower_behind_compaction_gets_snapshot_then_log() -> None:
    n = cluster()
    settle(n)
    n.isolate(3)
    for i in range(30):
        n[1].propose(b"s%d" % i)
    n.stabilize()
    settle(n)
    # The application snapshots and compacts on the leader.
    leader = n.nodes[1]
    applied = n[1].log.applied
    state = b"|".join(leader.applied_data())
    leader.storage.create_snapshot(applied, n[1].conf_state, state)
    leader.storage.compact(applied)
    for i in range(5):
        n[1].propose(b"t%d" % i)
    n.recover()
    settle(n, 5)
    node3 = n.nodes[3]
    assert node3.installed and node3.installed[-1].meta.index == applied
    assert node3.installed[-1].data == state
    assert n[3].log.last_index() == n[1].log.last_index()
    assert node3.applied_data()[-5:] == [b"t%d" % i for i in range(5)]
    assert n[1].prs[3].state == REPLICATE


def test_lost_snapshot_is_resent_after_timeout() -> None:
    cfg = RaftConfig(election_tick=10, heartbeat_tick=1, snapshot_timeout_tick=15)
    n = cluster(cfg)
    settle(n)
    n.isolate(3)
    for i in range(10):
        n[1].propose(b"s%d" % i)
    n.stabilize()
    settle(n)
    applied = n[1].log.applied
    n.nodes[1].storage.create_snapshot(applied, n[1].conf_state, b"img")
    n.nodes[1].storage.compact(applied)
    n.recover()
    lost = []
    n.add_filter(lambda m: not (type(m) is InstallSnapshot and not lost and not lost.append(m)))
    settle(n, 3)
    assert lost and n[1].prs[3].state == SNAPSHOT
    settle(n, 20)
    assert n.nodes[3].installed and n[3].log.last_index() == n[1].log.last_index()


def test_report_snapshot_failure_returns_to_probe() -> None:
    n = cluster()
    pr = n[1].prs[2]
    pr.become_snapshot(5)
    n[1].report_snapshot(2, ok=False)
    assert pr.state == PROBE and pr.pending_snapshot == 0


def test_compacted_follower_log_and_restart() -> None:
    """A node restarted from a compacted storage (snapshot + tail) rejoins."""
    n = cluster()
    for i in range(20):
        n[1].propose(b"r%d" % i)
    n.stabilize()
    settle(n)
    node2 = n.nodes[2]
    a = n[2].log.applied
    node2.storage.create_snapshot(a, n[2].conf_state, b"snap2")
    node2.storage.compact(a - 3)
    n.restart(2)
    n.propose(1, b"after-restart")
    settle(n)
    assert n[2].log.committed == n[1].log.committed
    assert n.nodes[2].applied_data()[-1] == b"after-restart"


def test_ready_contract_errors() -> None:
    n = cluster()
    n[1].propose(b"x")
    rd = n[1].ready()
    with pytest.raises(ReadyContractError):
        n[1].ready()
    assert not n[1].has_ready()
    with pytest.raises(ReadyContractError):
        n[1].advance(type(rd)())
    n[1].advance(rd)


def test_committed_entries_bounded_per_ready() -> None:
    cfg = RaftConfig(election_tick=10, heartbeat_tick=1, max_committed_size_per_ready=300)
    st = MemoryStorage.bootstrap([1])
    core = RaftCore(1, st, cfg, random.Random(0))
    sizes = []

    def drain() -> None:
        while core.has_ready():
            rd = core.ready()
            if rd.entries_to_append:
                st.append(rd.entries_to_append)
            if rd.hard_state:
                st.set_hard_state(rd.hard_state)
            if rd.committed_entries:
                sizes.append(sum(entry_size(e) for e in rd.committed_entries))
                assert len(rd.committed_entries) == 1 or sizes[-1] <= 300
            core.advance(rd)

    drain()
    core.campaign()
    drain()
    for _ in range(20):
        core.propose(b"c" * 50)
    drain()
    assert core.log.applied == core.log.last_index()
    assert len(sizes) >= 5


def test_truncation_between_ready_and_advance_is_not_marked_durable() -> None:
    """The ABA race: entries handed out in a Ready are replaced by a new leader's before
    advance(); they must not count as persisted and must be re-emitted."""
    st = MemoryStorage.bootstrap([1, 2, 3])
    core = RaftCore(2, st, CFG, random.Random(0))
    core.advance(core.ready())
    core.step(
        Append(
            1,
            2,
            2,
            prev_index=3,
            prev_term=1,
            commit=3,
            entries=[Entry(2, 4, 0, b"a"), Entry(2, 5, 0, b"b")],
        )
    )
    rd = core.ready()
    assert [e.index for e in rd.entries_to_append] == [4, 5]
    # Before rd is persisted, a leader of term 3 replaces index 5.
    core.step(Append(3, 2, 3, prev_index=4, prev_term=2, commit=3, entries=[Entry(3, 5, 0, b"B")]))
    st.append(rd.entries_to_append)
    core.advance(rd)
    assert core.log.persisted == 3
    rd2 = core.ready()
    assert [(e.index, e.term) for e in rd2.entries_to_append] == [(4, 2), (5, 3)]
    st.append(rd2.entries_to_append)
    core.advance(rd2)
    assert core.log.persisted == 5
    assert [e.data for e in st.entries(4, 6)] == [b"a", b"B"]


def test_follower_applies_only_locally_durable_entries() -> None:
    st = MemoryStorage.bootstrap([1, 2, 3])
    core = RaftCore(2, st, CFG, random.Random(0))
    core.advance(core.ready())
    core.step(
        Append(
            1,
            2,
            2,
            prev_index=3,
            prev_term=1,
            commit=5,
            entries=[Entry(2, 4, 0, b"a"), Entry(2, 5, 0, b"b")],
        )
    )
    rd = core.ready()
    assert core.log.committed == 5
    assert rd.committed_entries == []  # not persisted yet
    st.append(rd.entries_to_append)
    core.advance(rd)
    rd = core.ready()
    assert [e.data for e in rd.committed_entries] == [b"a", b"b"]
    core.advance(rd)


def test_follower_restarts_with_commit_and_reapplies() -> None:
    n = cluster()
    for i in range(5):
        n[1].propose(b"w%d" % i)
    n.stabilize()
    settle(n)
    n.restart(3)
    assert n.nodes[3].applied_data() == [b"w%d" % i for i in range(5)]
    assert n[3].role == Role.FOLLOWER


def test_stale_acks_are_dropped_on_term_change() -> None:
    """Defect 6 (soak seed 700022): a follower queued acks in term 2, then a term-3 Append
    truncated its log; the term-2 acks for the truncated indexes must not leave after the
    next fsync (they would claim entries that are not durable)."""
    ents, hs = [Entry(1, 1), Entry(1, 2)], HardState(term=2, vote=0, commit=2)
    st = MemoryStorage(hs)
    st.append(ents)
    core = RaftCore(2, st, CFG, random.Random(1))
    core.step(
        Append(
            1,
            2,
            2,
            prev_index=2,
            prev_term=1,
            commit=2,
            entries=[Entry(2, 3, 0, b"a"), Entry(2, 4, 0, b"b")],
        )
    )
    # No Ready taken yet: the ack for index 4 (term 2) is queued.
    core.step(Append(3, 2, 3, prev_index=2, prev_term=1, commit=2, entries=[Entry(3, 3, 0, b"c")]))
    rd = core.ready()
    acks = [m for m in rd.send_now + rd.send_after_persist if type(m) is AppendResp]
    assert acks and all(m.term == 3 for m in acks), acks
    assert max(m.index for m in acks if not m.reject) == 3
    assert rd.entries_to_append[-1].index == 3
