"""The shared Ready path applies the committed entries of a Ready while that Ready's fsync
runs (they were durable locally and on a quorum before it), and still sends append acks
only after the fsync: the order of its effects, and a live single-replica node."""

from __future__ import annotations

import asyncio
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
    orig = DiskStorage.sync

    def sync(self):  # type: ignore[no-untyped-def]
        if slow["on"]:
            time.sleep(0.3)
        return orig(self)

    monkeypatch.setattr(DiskStorage, "sync", sync)

    async def main() -> float:
        async with Cluster(tmp_path, n=1, durability="disk") as c:
            leader = await c.leader()
            await leader.propose(encode_command(KvPut("a", b"1")))
            slow["on"] = True
            t0 = time.monotonic()
            first = asyncio.ensure_future(leader.propose(encode_command(KvPut("b", b"2"))))
            await asyncio.sleep(0.1)  # "b" is in its fsync; "c" waits for the next Ready
            second = asyncio.ensure_future(leader.propose(encode_command(KvPut("c", b"3"))))
            await first
            took = time.monotonic() - t0
            await second
            slow["on"] = False
            return took

    took = asyncio.run(asyncio.wait_for(main(), 60))
    # One fsync (0.3 s) plus scheduling; waiting for the second fsync makes it >= 0.6 s.
    assert 0.3 <= took < 0.55, took
