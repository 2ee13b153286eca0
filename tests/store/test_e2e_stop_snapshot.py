"""A durable master snapshots at a graceful stop, so its next start restores the image
instead of replaying the whole log (a batch entry holds thousands of keys: see the
bench/store.py 1,000,000-object case); kill -9 leaves no new snapshot and the restart
replays the log. Either way every acknowledged object is back."""

from __future__ import annotations

import os
import time

from kvmesh.store import protocol as P
from kvmesh.store.cluster import StoreCluster
from kvmesh.store.rpc import MasterClient
from kvmesh.store.types import ReplicateConfig


class _Node:
    """What ``MasterService._snapshot_by_keys`` reads of its node: the applied and recovered
    indexes; ``snapshot_now`` counts the snapshots and moves a fake clock by ``took_s``."""

    def __init__(self, clock: list[float] | None = None, took_s: float = 0.0) -> None:
        self.taken = 0
        self.applied_index = self.recovered_index = 0
        self.clock, self.took_s = clock, took_s

    async def snapshot_now(self) -> int:
        self.taken += 1
        if self.clock is not None:
            self.clock[0] += self.took_s
        return 1


async def _keys_applied(svc, node: _Node, n: int) -> int:
    """``n`` more keys applied, then the check each apply runs; the snapshots taken so far."""
    svc.sm.applied_keys += n
    svc._snapshot_by_keys(node)
    if svc._snap_task is not None:
        await svc._snap_task
    return node.taken


def _snapshots(d: str) -> list[str]:
    snap = os.path.join(d, "1", "snap")
    return sorted(os.listdir(snap)) if os.path.isdir(snap) else []


def _exists(addr: str, keys: list[str]) -> list[int]:
    rpc = MasterClient([addr], name="t-check", timeout=30)
    try:
        r = rpc.call(lambda rid: P.ExistsReq(rid, keys))
        assert type(r) is P.CodesResp, r
        return r.codes
    finally:
        rpc.close()


def test_graceful_stop_snapshots_kill_does_not(tmp_path) -> None:
    d = str(tmp_path)
    with StoreCluster(d, 1, durability="disk", extra_args=["--node-ttl-s", "3600"]) as cl:
        cl.start_all()
        rpc = MasterClient([cl.address], node_id="n", timeout=30)
        r = rpc.mutate(lambda rid, s: P.MountReq(rid, s, "n", "seg", "127.0.0.1:1", "h", 1 << 30))
        assert type(r) is P.CodesResp and r.codes == [0]
        keys = [f"k{i}" for i in range(3000)]
        cfg = ReplicateConfig()
        ps = rpc.mutate(lambda rid, s: P.PutStartReq(rid, s, keys, [4096] * len(keys), cfg))
        pe = rpc.mutate(lambda rid, s: P.PutEndReq(rid, s, keys, ps.versions))
        assert type(pe) is P.CodesResp and not any(pe.codes)
        rpc.close()
        probe = [keys[0], keys[-1], "absent"]
        before = _snapshots(d)
        cl.kill(1)
        assert _snapshots(d) == before  # kill -9: nothing written
        cl.start(1)
        assert _exists(cl.address, probe) == [1, 1, 0]  # replayed from the log
        cl.stop(1)
        after = _snapshots(d)
        assert after and after != before  # the graceful stop wrote a snapshot
        cl.start(1)
        assert _exists(cl.address, probe) == [1, 1, 0]  # restored from it


def test_snapshot_after_snapshot_keys_applied(tmp_path) -> None:
    """Entries of thousands of keys reach the entry-count threshold late: the master also
    snapshots by keys applied, so a crash replays a bounded log."""
    d = str(tmp_path)
    args = ["--node-ttl-s", "3600", "--snapshot-keys", "2000"]
    with StoreCluster(d, 1, durability="disk", extra_args=args) as cl:
        cl.start_all()
        rpc = MasterClient([cl.address], node_id="n", timeout=30)
        r = rpc.mutate(lambda rid, s: P.MountReq(rid, s, "n", "seg", "127.0.0.1:1", "h", 1 << 30))
        assert type(r) is P.CodesResp and r.codes == [0]
        assert _snapshots(d) == []
        keys = [f"k{i}" for i in range(1500)]
        cfg = ReplicateConfig()
        ps = rpc.mutate(lambda rid, s: P.PutStartReq(rid, s, keys, [4096] * len(keys), cfg))
        pe = rpc.mutate(lambda rid, s: P.PutEndReq(rid, s, keys, ps.versions))
        assert type(pe) is P.CodesResp and not any(pe.codes)
        rpc.close()
        deadline = time.monotonic() + 20
        while not _snapshots(d):  # 3000 keys applied (PutStart + PutEnd) > 2000
            assert time.monotonic() < deadline, "no snapshot by keys"
            time.sleep(0.05)
        cl.kill(1)
        cl.start(1)
        assert _exists(cl.address, [keys[0], keys[-1]]) == [1, 1]


def test_snapshot_cadence_scales_with_the_table(tmp_path) -> None:
    """Snapshots by keys come every max(snapshot_keys, snapshot_fraction x objects) keys
    applied: a big table is not re-imaged every snapshot_keys keys."""
    import asyncio

    from kvmesh.store.config import ServiceConfig
    from kvmesh.store.service import MasterService

    cfg = ServiceConfig(
        listen="127.0.0.1:0", data_dir=str(tmp_path), snapshot_keys=100, snapshot_fraction=0.5
    )
    svc = MasterService(cfg)
    sm = svc.sm
    node = _Node()

    async def keys_applied(n: int) -> int:
        return await _keys_applied(svc, node, n)

    async def main() -> None:
        assert await keys_applied(99) == 0
        assert await keys_applied(1) == 1  # the floor: 100 keys, a small table
        rows = [f"k{i}" for i in range(1000)]
        sm.objects.put_run(rows, [1] * 1000, 1, 0.0, 1, list(range(1000)), 0, 0.0)
        assert await keys_applied(499) == 1  # 1,000 objects: every 500 keys now
        assert await keys_applied(1) == 2

    asyncio.run(main())


def test_snapshots_by_keys_take_at_most_their_share_of_the_time(tmp_path) -> None:
    """With snapshot_max_share s, a snapshot by keys that took d starts the next no sooner
    than d x (1 - s) / s after it ended, however many keys arrive meanwhile (a bulk load
    into a big table would otherwise image it back to back); the keys stay counted."""
    import asyncio

    from kvmesh.store.config import ServiceConfig
    from kvmesh.store.service import MasterService

    clock = [100.0]
    node = _Node(clock, took_s=10.0)  # each snapshot takes 10 s of the (fake) clock
    cfg = ServiceConfig(
        listen="127.0.0.1:0",
        data_dir=str(tmp_path),
        snapshot_keys=100,
        snapshot_fraction=0.0,
        snapshot_max_share=0.25,  # 10 s each: then 30 s without
    )
    svc = MasterService(cfg)
    svc._clock = lambda: clock[0]

    async def keys_applied(n: int, after_s: float = 0.0) -> int:
        clock[0] += after_s
        return await _keys_applied(svc, node, n)

    async def main() -> None:
        assert await keys_applied(100) == 1  # ends at 110: none before 140
        assert await keys_applied(500, after_s=29.0) == 1  # keys due, time not
        assert await keys_applied(1, after_s=0.5) == 1
        assert await keys_applied(1, after_s=0.6) == 2  # 140.1: the counted keys start it
        assert await keys_applied(100, after_s=29.9) == 2  # ended at 150.1: not before 180.1
        assert await keys_applied(100, after_s=0.2) == 3

    asyncio.run(main())


def test_no_snapshot_by_keys_while_a_restart_replays_its_log(tmp_path) -> None:
    """A replica replaying the log it restarted with takes no snapshot by keys (those
    entries are durable already; an image meanwhile, 11 s at 10 M objects, only slows the
    replay clients wait for): the keys stay counted and the snapshot starts as soon as
    it has applied what it found in its log."""
    import asyncio

    from kvmesh.store.config import ServiceConfig
    from kvmesh.store.service import MasterService

    cfg = ServiceConfig(
        listen="127.0.0.1:0", data_dir=str(tmp_path), snapshot_keys=100, snapshot_fraction=0.0
    )
    svc = MasterService(cfg)
    node = _Node()
    node.recovered_index = 500

    async def applied(n: int, index: int) -> int:
        node.applied_index = index
        return await _keys_applied(svc, node, n)

    async def main() -> None:
        assert await applied(150, 100) == 0  # keys due, replay not done
        assert await applied(5000, 499) == 0
        assert await applied(0, 500) == 1  # caught up: the counted keys start it
        assert await applied(99, 600) == 1
        assert await applied(1, 601) == 2  # and from then on, by keys as before

    asyncio.run(main())
