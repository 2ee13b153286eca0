"""Wire types, configuration validation, MemoryStorage and the quorum/progress helpers."""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.replog.core.progress import (
    PROBE,
    REPLICATE,
    SNAPSHOT,
    VOTE_LOST,
    VOTE_PENDING,
    VOTE_WON,
    Inflights,
    Progress,
    committed_index,
    vote_result,
)
from kvmesh.replog.storage.memory import MemoryStorage
from kvmesh.replog.types import (
    ENTRY_OVERHEAD,
    Append,
    AppendResp,
    ConfChange,
    ConfChangeType,
    ConfState,
    Entry,
    EntryKind,
    HardState,
    Heartbeat,
    HeartbeatResp,
    InstallSnapshot,
    InstallSnapshotResp,
    LogCompacted,
    LogStorage,
    LogUnavailable,
    PreVote,
    PreVoteResp,
    RaftConfig,
    ReadIndex,
    ReadIndexResp,
    Snapshot,
    SnapshotMeta,
    StorageError,
    TimeoutNow,
    Vote,
    VoteResp,
    bootstrap_entries,
    decode_conf_change,
    decode_message,
    encode_conf_change,
    encode_message,
    limit_size,
)

SNAP = Snapshot(SnapshotMeta(10, 3, ConfState((1, 2, 3), (4,))), b"\x00image")
MESSAGES = [
    Vote(1, 2, 5, 10, 4),
    Vote(1, 2, 5, 10, 4, transfer=True),
    VoteResp(2, 1, 5, reject=True),
    PreVote(1, 2, 6, 10, 4),
    PreVoteResp(2, 1, 6, reject=False),
    Append(
        1,
        2,
        5,
        9,
        4,
        8,
        [Entry(5, 10, 0, b"a"), Entry(5, 11, 1, encode_conf_change(ConfChange(0, 4)))],
    ),
    Append(1, 2, 5, 9, 4, 8),
    AppendResp(2, 1, 5, 11),
    AppendResp(2, 1, 5, 9, reject=True, hint_index=7, hint_term=3),
    Heartbeat(1, 2, 5, 8, ctx=17),
    HeartbeatResp(2, 1, 5, ctx=17),
    InstallSnapshot(1, 2, 5, SNAP),
    InstallSnapshotResp(2, 1, 5, 10),
    TimeoutNow(1, 2, 5),
    ReadIndex(2, 1, 5, b"ctx"),
    ReadIndexResp(1, 2, 5, 11, b"ctx"),
]


@pytest.mark.parametrize("m", MESSAGES, ids=lambda m: type(m).__name__)
def test_message_roundtrip(m) -> None:
    b = encode_message(m)
    out = decode_message(b)
    assert type(out) is type(m) and out == m


def test_message_tags_are_distinct_and_compact() -> None:
    tags = {msgspec.inspect.type_info(type(m)).tag for m in MESSAGES}
    assert len(tags) == len({type(m) for m in MESSAGES})
    assert len(encode_message(Heartbeat(1, 2, 5, 8, ctx=17))) < 12


def test_decode_rejects_garbage() -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode_message(b"\x93\x63\x01\x02")
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode_message(b"\xff\xff")


def test_conf_change_roundtrip() -> None:
    cc = ConfChange(int(ConfChangeType.ADD_LEARNER), 7, b"127.0.0.1:7007")
    assert decode_conf_change(encode_conf_change(cc)) == cc


def test_bootstrap_entries() -> None:
    ents, hs = bootstrap_entries([3, 1, 2], learners=[4])
    assert [decode_conf_change(e.data).node_id for e in ents] == [1, 2, 3, 4]
    assert all(e.kind == EntryKind.CONF_CHANGE and e.term == 1 for e in ents)
    assert [e.index for e in ents] == [1, 2, 3, 4]
    assert hs == HardState(term=1, vote=0, commit=4)
    with pytest.raises(ValueError):
        bootstrap_entries([])
    with pytest.raises(ValueError):
        bootstrap_entries([1, 2], learners=[2])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(heartbeat_tick=0), "heartbeat_tick"),
        (dict(election_tick=2, heartbeat_tick=2), "election_tick"),
        (dict(election_tick=10, max_election_tick=10), "max_election_tick"),
        (dict(lease_drift_bound=1.0), "lease_drift_bound"),
        (dict(max_size_per_msg=8), "max_size_per_msg"),
        (dict(max_inflight_msgs=0), "max_inflight_msgs"),
        (dict(max_uncommitted_bytes=-1), "max_uncommitted_bytes"),
        (dict(max_committed_size_per_ready=0), "max_committed_size_per_ready"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RaftConfig(**kwargs)


def test_config_from_json() -> None:
    cfg = msgspec.json.decode(
        b'{"election_tick": 20, "read_only_option": "lease_based"}', type=RaftConfig
    )
    assert cfg.election_range == (20, 40) and cfg.lease_ticks == 17


# -- MemoryStorage ------------------------------------------------------------------------------


def _storage(n: int = 10) -> MemoryStorage:
    st = MemoryStorage()
    st.append([Entry(1 + i // 4, i, 0, b"x" * i) for i in range(1, n + 1)])
    return st


def test_memstorage_is_a_log_storage() -> None:
    assert isinstance(MemoryStorage(), LogStorage)


def test_memstorage_reads_and_bounds() -> None:
    st = _storage()
    assert (st.first_index(), st.last_index()) == (1, 10)
    assert st.term(0) == 0 and st.term(4) == 2
    with pytest.raises(LogUnavailable):
        st.term(11)
    with pytest.raises(LogUnavailable):
        st.entries(5, 12)
    assert [e.index for e in st.entries(3, 6)] == [3, 4, 5]
    # size limit: at least one entry, never over the budget otherwise
    budget = (3 + ENTRY_OVERHEAD) + (4 + ENTRY_OVERHEAD)
    assert [e.index for e in st.entries(3, 10, budget)] == [3, 4]
    assert [e.index for e in st.entries(3, 10, 1)] == [3]


def test_memstorage_truncating_append() -> None:
    st = _storage()
    st.append([Entry(9, 6, 0, b"n6"), Entry(9, 7, 0, b"n7")])
    assert st.last_index() == 7 and st.term(6) == 9 and st.term(5) == 2
    with pytest.raises(StorageError, match="gap"):
        st.append([Entry(9, 9, 0, b"gap")])


def test_memstorage_snapshot_and_compaction() -> None:
    st = _storage()
    cs = ConfState((1, 2, 3))
    snap = st.create_snapshot(6, cs, b"img")
    assert snap.meta == SnapshotMeta(6, st.term(6), cs)
    st.compact(6)
    assert st.first_index() == 7 and st.term(6) == snap.meta.term
    with pytest.raises(LogCompacted):
        st.term(5)
    with pytest.raises(LogCompacted):
        st.entries(6, 8)
    assert st.initial_state()[1] == cs
    with pytest.raises(StorageError):
        st.create_snapshot(5, cs, b"old")
    # appending entries covered by the snapshot is a no-op for that part
    st.append([Entry(2, 5, 0, b"x" * 5), Entry(2, 6, 0, b"x" * 6), Entry(3, 7, 0, b"new7")])
    assert st.term(7) == 3 and st.first_index() == 7


def test_memstorage_apply_snapshot_replaces_log() -> None:
    st = _storage()
    st.apply_snapshot(SNAP)
    assert (st.first_index(), st.last_index()) == (11, 10)
    assert st.term(10) == 3
    with pytest.raises(StorageError):
        st.apply_snapshot(Snapshot(SnapshotMeta(5, 1), b""))


def test_limit_size_keeps_at_least_one() -> None:
    ents = [Entry(1, i, 0, b"y" * 100) for i in range(1, 5)]
    assert limit_size(ents, 10) == ents[:1]
    assert limit_size(ents, None) == ents
    assert limit_size(ents, 2 * (100 + ENTRY_OVERHEAD)) == ents[:2]


# -- progress and quorum ------------------------------------------------------------------------


def test_inflights_window() -> None:
    f = Inflights(3, max_bytes=250)
    f.add(5, 100)
    f.add(7, 100)
    assert not f.full()
    f.add(9, 100)
    assert f.full()
    f.free_le(7)
    assert len(f) == 1 and not f.full()
    f.free_first_one()
    assert len(f) == 0


def test_progress_transitions_and_decrement() -> None:
    pr = Progress(next_index=11, max_inflight=4)
    assert pr.state == PROBE
    pr.sent_entries(12, 2, 10)
    assert pr.is_paused()
    assert not pr.maybe_decr_to(5, 3)  # stale rejection (not for next - 1)
    assert pr.maybe_decr_to(10, 6)
    assert pr.next == 7 and not pr.is_paused()
    assert pr.maybe_update(8)
    pr.become_replicate()
    assert pr.state == REPLICATE and pr.next == 9
    pr.sent_entries(12, 4, 40)
    assert pr.next == 13
    assert not pr.maybe_decr_to(7, 0)  # at or below match: stale
    assert pr.maybe_decr_to(10, 0) and pr.next == 9
    pr.become_snapshot(20)
    assert pr.state == SNAPSHOT and pr.is_paused()
    pr.become_probe()
    assert pr.state == PROBE and pr.next == 21


@pytest.mark.parametrize(
    "matches,expected",
    [([5], 5), ([5, 3, 4], 4), ([1, 9, 9, 2], 2), ([7, 7, 1, 1, 7], 7), ([], 0)],
)
def test_committed_index(matches: list[int], expected: int) -> None:
    assert committed_index(matches) == expected


def test_vote_result() -> None:
    assert vote_result((1, 2, 3), {1: True, 2: True}) == VOTE_WON
    assert vote_result((1, 2, 3), {1: True, 2: False}) == VOTE_PENDING
    assert vote_result((1, 2, 3), {1: True, 2: False, 3: False}) == VOTE_LOST
    assert vote_result((1, 2, 3, 4), {1: True, 2: True}) == VOTE_PENDING
    assert vote_result((1, 2, 3, 4), {1: True, 2: False, 3: False}) == VOTE_LOST
