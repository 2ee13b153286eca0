"""The shared Ready path applies the committed entries of a Ready while that Ready's fsync
runs (they were durable locally and on a quorum before it), and still sends append acks
only after the fsync: the order of its effects, and a live single-replica node."""

from __future__ import annotations

import asyncio
import threading
import time

from kvmesh.replog.readypath import SYNC, SYNC_BEGIN, ReadyPath
from kvmesh.replog.storage.disk import DiskStorage
from kvmesh.replog.types import Entry, Ready


class _Log:
    applied = 0


class _Core:
    log = _Log()
    conf_state = None

    def __init__(self, trace: list) -> None:
        self.trace = trace

    def advance(self, rd: Ready) -> None:
        self.trace.append("advance")


class _Storage:
    def __init__(self, trace: list) -> None:
        self.trace = trace

    def write(self, rd: Ready, staged: object) -> bool:
        self.trace.append("write")
        return rd.must_sync


class _Host:
    def __init__(self, trace: list) -> None:
        self.trace = trace

    def send(self, msgs: list, after_persist: bool) -> None:
        self.trace.append("send-after" if after_persist else "send-now")

    def apply(self, entries: list) -> None:
        self.trace.append(("apply", [e.index for e in entries]))

    def before_advance(self, rd: Ready) -> None:
        pass

    def after_advance(self, rd: Ready) -> None:
        pass


def _effects(rd: Ready) -> list:
    trace: list = []
    path = ReadyPath(_Core(trace), _Storage(trace), _Host(trace))  # type: ignore[arg-type]
    for eff in path.run(rd):
        trace.append(eff)
    return trace


def test_committed_entries_apply_while_the_fsync_runs() -> None:
    rd = Ready(
        entries_to_append=[Entry(2, 11), Entry(2, 12)],
        committed_entries=[Entry(2, 9), Entry(2, 10)],
        send_now=["append"],
        send_after_persist=["ack"],
        must_sync=True,
    )
    trace = _effects(rd)
    assert trace == [
        "write",
        "send-now",
        SYNC_BEGIN,
        ("apply", [9, 10]),
        SYNC,
        "send-after",
        "advance",
    ], trace


def test_apply_slices_are_bounded_by_bytes_too() -> None:
    """Slices end at ``apply_slice`` entries or once ``apply_bytes`` of entry data were
    applied (the entry reaching the bound is the slice's last): a store entry can name
    thousands of keys, and 1,000 of them applied without a yield held a 10 M-object
    replay's loop for seconds (issue 21). Without a byte bound, entries alone decide."""
    ents = [Entry(2, i, data=b"x" * z) for i, z in zip(range(1, 8), (10, 50, 45, 1, 200, 5, 5))]

    def slices(**kw: int) -> list:
        trace: list = []
        path = ReadyPath(_Core(trace), _Storage(trace), _Host(trace), **kw)  # type: ignore[arg-type]
        for eff in path.run(Ready(committed_entries=ents, must_sync=False)):
            trace.append(eff)
        assert path.applied == 7
        return [t[1] for t in trace if type(t) is tuple]

    assert slices(apply_slice=3, apply_bytes=100) == [[1, 2, 3], [4, 5], [6, 7]]
    assert slices(apply_slice=2, apply_bytes=100) == [[1, 2], [3, 4], [5], [6, 7]]
    assert slices(apply_slice=3) == [[1, 2, 3], [4, 5, 6], [7]]
    assert slices(apply_slice=1000, apply_bytes=1) == [[i] for i in range(1, 8)]


def test_no_fsync_no_sync_effects() -> None:
    rd = Ready(committed_entries=[Entry(2, 9)], send_after_persist=["ack"], must_sync=False)
    assert _effects(rd) == ["write", ("apply", [9]), "send-after", "advance"]


def test_a_live_replica_answers_before_a_slow_fsync_of_later_entries(tmp_path, monkeypatch):
    """A disk whose fsync takes 0.3 s: a proposal committed in one Ready is answered while
    the next Ready (holding the entries proposed meanwhile) is still in its fsync; with the
    apply after the fsync, that answer waited for the second fsync too."""
    from kvmesh.replog.kvsm import KvPut, encode_command

    from .test_node import Cluster

    slow = {"on": False}
    syncs: list[tuple[float, float]] = []  # (start, end) of each slow fsync
    began = threading.Event()
    orig = DiskStorage.sync

    def sync(self):  # type: ignore[no-untyped-def]
        if not slow["on"]:
            return orig(self)
        t0 = time.monotonic()
        began.set()
        time.sleep(0.3)
        try:
            return orig(self)
        finally:
            syncs.append((t0, time.monotonic()))

    monkeypatch.setattr(DiskStorage, "sync", sync)

    async def main() -> float:
        async with Cluster(tmp_path, n=1, durability="disk") as c:
            leader = await c.leader()
            await leader.propose(encode_command(KvPut("a", b"1")))
            slow["on"] = True
            first = asyncio.ensure_future(leader.propose(encode_command(KvPut("b", b"2"))))
            # "b" is in its fsync; "c" waits for the next Ready (an event, not a sleep: on a
            # slow machine "b" may not have reached its fsync after any fixed time).
            assert await asyncio.to_thread(began.wait, 30)
            second = asyncio.ensure_future(leader.propose(encode_command(KvPut("c", b"3"))))
            await first
            answered = time.monotonic()
            await second
            slow["on"] = False
            return answered

    answered = asyncio.run(asyncio.wait_for(main(), 60))
    # Ordered by events, not by wall-clock bounds (a loaded machine stretches any of them):
    # "b" was answered after its own fsync and before the fsync of the Ready holding "c" ended.
    assert len(syncs) >= 2, syncs
    assert syncs[0][1] <= answered < syncs[1][1], (answered, syncs)


def test_a_leader_replicates_entries_proposed_during_its_fsync(tmp_path, monkeypatch):
    """While the leader's fsync of one entry runs (0.4 s here), an entry proposed meanwhile
    reaches the followers' logs at once (``RaftCore.take_send_now``), not after it; the
    leader still answers it only once its own copy is durable. Without the early sends
    (planted: a plain wait for the fsync) the test fails: no append and no heartbeat leaves
    the leader for 0.4 s, and the followers (elections after 0.2-0.4 s) elect another."""
    from kvmesh.replog.kvsm import KvPut, encode_command

    from .test_node import Cluster

    slow = {"storage": None}
    began: list[float] = []  # per slow fsync: when it began, and an event set when it ends
    ended: list[threading.Event] = []
    orig = DiskStorage.sync

    def sync(self):  # type: ignore[no-untyped-def]
        if self is not slow["storage"]:
            return orig(self)
        done = threading.Event()
        ended.append(done)
        began.append(time.monotonic())
        time.sleep(0.4)
        try:
            return orig(self)
        finally:
            done.set()

    monkeypatch.setattr(DiskStorage, "sync", sync)

    async def main() -> tuple[int, int, int]:
        async with Cluster(tmp_path, n=3, durability="disk") as c:
            leader = await c.leader()
            await leader.propose(encode_command(KvPut("a", b"1")))
            slow["storage"] = leader.storage
            first = asyncio.ensure_future(leader.propose(encode_command(KvPut("b", b"2"))))
            # "b" is in the leader's fsync: an event, not a fixed 0.1 s (on a loaded machine
            # the fsync may begin later, and "c" would then join "b"'s Ready).
            end = time.monotonic() + 30
            while not began:
                assert time.monotonic() < end, "the leader never began its fsync"
                await asyncio.sleep(0.005)
            running = ended[-1]
            idx = leader.core.log.last_index() + 1
            second = asyncio.ensure_future(leader.propose(encode_command(KvPut("c", b"3"))))
            # The followers hold "c" while that fsync still runs (a poll that ends at once).
            followers = [n for n in c.nodes.values() if n is not leader]
            seen = 0
            while not running.is_set():
                seen = sum(1 for n in followers if n.core.log.last_index() >= idx)
                if seen == 2:
                    break
                await asyncio.sleep(0.005)
            early = leader.metrics["early_sends"]
            await first
            await second
            slow["storage"] = None
            return seen, early, idx

    seen, early, idx = asyncio.run(asyncio.wait_for(main(), 60))
    assert early >= 1 and seen == 2, (seen, early, idx)


def test_take_send_now_only_for_a_leader_with_a_ready_outstanding() -> None:
    """The core hands out send-now messages between Readies only to a leader whose Ready
    is outstanding: the appends of entries proposed after that Ready."""
    from kvmesh.replog.sim.harness import Network
    from kvmesh.replog.types import Append, RaftConfig

    n = Network((1, 2, 3), RaftConfig(election_tick=10, heartbeat_tick=1))
    n.elect(1)
    n.tick_all(3)
    leader, follower = n[1], n[2]
    leader.propose(b"a")
    assert leader.take_send_now() == []  # no Ready outstanding: ready() hands them out
    rd = leader.ready()
    assert sorted(len(m.entries) for m in rd.send_now if type(m) is Append) == [1, 1]
    leader.propose(b"b")
    early = leader.take_send_now()
    apps = [m for m in early if type(m) is Append]
    assert sorted(m.to for m in apps) == [2, 3]
    assert all([e.data for e in m.entries] == [b"b"] for m in apps)
    assert leader.take_send_now() == []  # taken once
    leader.advance(rd)
    rd2 = leader.ready()
    assert [e.data for e in rd2.entries_to_append] == [b"b"]  # still persisted as usual
    assert not [m for m in rd2.send_now if type(m) is Append and m.entries]
    leader.advance(rd2)
    assert follower.take_send_now() == []  # a follower: never
