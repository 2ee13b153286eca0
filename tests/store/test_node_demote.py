"""The storage node's demotion pipeline (kvmesh/store/tiercopy.py: ``TierCopier.demote``
and ``_end``), in one process: a real engine, memory segment and disk segment, a stand-in
master that records the ``DemoteEndReq`` it gets. What it checks: each batch is written,
then fdatasync-ed, then checksummed, and only then ended (the master makes a disk copy
COMPLETE from that end alone); the crcs are those of the bytes on disk; and the next batch
is written while the previous batch's fdatasync and end are under way (the pipeline,
docs/store.md "Disk tier")."""

from __future__ import annotations

import threading
from typing import Any

import crc32c
import numpy as np

from kvmesh.store import protocol as P
from kvmesh.store import tiercopy
from kvmesh.store.node import StorageNode
from kvmesh.store.types import DemoteTask, ObjectReplica, ReplicaDesc
from kvmesh.transfer import EngineConfig, TransferEngine

OBJ = 64 << 10


class _Master:
    """Answers each DemoteEndReq with all codes 0 and the tasks not yet ended."""

    node_id = "n0"
    role = "node"
    name = "n0"

    def __init__(self, node: list[StorageNode], tasks: list[DemoteTask], log: list[Any]) -> None:
        self.node, self.left, self.log = node, list(tasks), log
        self.second_write = threading.Event()
        self.overlapped: bool | None = None  # the first sync saw the second write start

    def mutate(self, make: Any, *, timeout: float | None = None) -> Any:
        req = make(1, P.Session(1, 1))
        assert type(req) is P.DemoteEndReq
        self.log.append(("end", list(req.keys), list(req.crcs)))
        done = set(req.keys)
        self.left = [t for t in self.left if t.key not in done]
        return P.DemoteTasksResp(1, [0] * len(req.keys), self.left)


def _setup(tmp_path, n: int, monkeypatch) -> tuple[StorageNode, _Master, list, np.ndarray]:
    eng = TransferEngine(config=EngineConfig(node_id="n0"))
    log: list[Any] = []
    tasks_box: list[StorageNode] = []
    src = np.random.default_rng(1).integers(0, 256, n * OBJ, dtype=np.uint8)
    tasks = [
        DemoteTask(
            f"k{i}",
            i + 1,
            OBJ,
            ObjectReplica([ReplicaDesc("mem", "n0", eng.address, i * OBJ, OBJ)]),
            ObjectReplica([ReplicaDesc("mem.disk", "n0", eng.address, i * OBJ, OBJ)]),
        )  # fmt: skip
        for i in range(n)
    ]
    master = _Master(tasks_box, tasks, log)
    node = StorageNode(master, n * OBJ, engine=eng, segment="mem", node_id="n0")  # type: ignore[arg-type]
    tasks_box.append(node)
    node.region = eng.register(src.copy())
    eng.publish(node.region, "mem")
    node.disk = eng.register_disk(str(tmp_path / "d.seg"), n * OBJ, name="mem.disk")
    writes = 0
    real_transfer, real_sync = eng.transfer, eng.sync_segment

    def transfer(op: Any, *a: Any, **kw: Any) -> Any:
        nonlocal writes
        out = real_transfer(op, *a, **kw)
        writes += 1
        log.append(("write", writes))
        if writes == 2:
            master.second_write.set()
        return out

    def sync(seg: Any, **kw: Any) -> None:
        if master.overlapped is None:
            # the first batch's fdatasync waits (up to 10 s) for the node to write the
            # next batch meanwhile: off the write path, it does not wait at all
            master.overlapped = master.second_write.wait(10.0)
        real_sync(seg, **kw)
        log.append(("sync",))

    monkeypatch.setattr(eng, "transfer", transfer)
    monkeypatch.setattr(eng, "sync_segment", sync)
    return node, master, tasks, src


def test_each_batch_is_synced_before_its_end_and_the_next_is_written_meanwhile(
    tmp_path, monkeypatch
) -> None:

    # two batches of 4 objects
    monkeypatch.setattr(tiercopy, "STAGE_BYTES", 4 * OBJ)
    node, master, tasks, src = _setup(tmp_path, 8, monkeypatch)
    try:
        assert node.copier.demote(list(tasks)) == 8
        log = master.log
        ends = [e for e in log if e[0] == "end"]
        assert [len(e[1]) for e in ends] == [4, 4]
        # every end comes after a sync that comes after its own batch's write
        for e in ends:
            i = log.index(e)
            before = [x[0] for x in log[:i]]
            last_sync = len(before) - 1 - before[::-1].index("sync")
            batch = int(e[1][0][1:]) // 4 + 1  # the write that carried it (1 or 2)
            assert log.index(("write", batch)) < last_sync < i
        assert master.overlapped, "the second batch was not written while the first synced"
        # the crcs ended are those of the bytes on disk
        disk = np.fromfile(tmp_path / "d.seg", np.uint8)[: 8 * OBJ]
        assert disk.tobytes() == src.tobytes()
        got = dict(zip([k for e in ends for k in e[1]], [c for e in ends for c in e[2]]))
        want = {f"k{i}": crc32c.crc32c(src[i * OBJ : (i + 1) * OBJ]) for i in range(8)}
        assert got == want
    finally:
        node.engine.close()


def test_a_reply_saying_soon_makes_the_node_ask_again_at_once(monkeypatch) -> None:
    """``DemoteTasksResp.soon`` (the master is proposing a batch a heartbeat set off): the
    node's next poll comes DEMOTE_BUSY_POLL_S later, not a poll period later; without it,
    a period. The waits the loop asks for are recorded, no clock is read."""
    import kvmesh.store.node as node_mod

    replies = [
        P.DemoteTasksResp(1, [0], [], [], True),
        P.DemoteTasksResp(1, [0], [], [], False),
        P.DemoteTasksResp(1, [0], [], [], False),
    ]

    class M:
        node_id = role = name = "n0"

        def call(self, make: Any, *, timeout: float | None = None) -> Any:
            assert type(make(1)) is P.HeartbeatReq and make(1).work > 0
            return replies.pop(0)

    node = StorageNode(M(), 1 << 20, engine=object(), node_id="n0", heartbeat_s=2.0)  # type: ignore[arg-type]
    node.disk = object()  # type: ignore[assignment]  # a disk: heartbeats ask for work
    waits: list[float] = []

    def wait(t: float) -> bool:
        waits.append(t)
        return not replies  # stop once every reply was taken

    monkeypatch.setattr(node._stop, "wait", wait)
    monkeypatch.setattr(node._stop, "is_set", lambda: False)
    node._beat_loop()
    period = node_mod.DEMOTE_POLL_S
    assert waits == [period, node_mod.DEMOTE_BUSY_POLL_S, period, period]


def test_a_failed_fdatasync_on_the_end_thread_is_reported_and_stops_the_copying(
    tmp_path, monkeypatch
) -> None:
    """The first batch's fdatasync fails (``EIO``) on the end thread: that batch is
    reported failed (``DemoteEndReq.failed``: the master revokes it at once and backs off
    from this disk) and never ended, and the node stops copying until its next poll."""

    monkeypatch.setattr(tiercopy, "STAGE_BYTES", 4 * OBJ)
    node, master, tasks, src = _setup(tmp_path, 12, monkeypatch)
    failed: list[list[str]] = []
    monkeypatch.setattr(node.copier, "report_failed", lambda ts: failed.append([t.key for t in ts]))

    def sync(seg: Any, **kw: Any) -> None:
        master.second_write.wait(10.0)  # the next batch is written meanwhile
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(node.engine, "sync_segment", sync)
    try:
        assert node.copier.demote(list(tasks)) == 0
        # the batch written meanwhile fails its sync as well: both reported, none ended
        assert failed == [[f"k{i}" for i in range(4)], [f"k{i}" for i in range(4, 8)]]
        assert not [e for e in master.log if e[0] == "end"]
        # the third batch is never written
        assert [w for w in master.log if w[0] == "write"] == [("write", 1), ("write", 2)]
    finally:
        node.engine.close()
