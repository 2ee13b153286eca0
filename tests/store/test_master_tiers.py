"""The disk tier in the master's state machine (docs/store.md, "Disk tier"): segments have a
medium, puts are placed in memory only, usage is per medium, snapshots keep the medium."""

from __future__ import annotations

import msgspec

from kvmesh.store.master.commands import Mount, PutEnd, PutStart, encode_command
from kvmesh.store.master.state import MasterConfig, StoreStateMachine
from kvmesh.store.types import ReplicateConfig

CFG = MasterConfig(slice_limit=4096, align=64, remount_quarantine=3.0)


class _SM:
    def __init__(self) -> None:
        self.sm = StoreStateMachine(CFG)
        self.i = 0

    def __call__(self, cmd):
        self.i += 1
        return self.sm.apply(self.i, encode_command(cmd))


def _pool(mem: int = 1 << 16, disk: int = 1 << 20, nodes: int = 1) -> _SM:
    a = _SM()
    for n in range(nodes):
        assert a(Mount(f"n{n}", f"m{n}", f"ep{n}", f"h{n}", mem, 0.0)).codes == [0]
        assert a(
            Mount(f"n{n}", f"m{n}.disk", f"ep{n}", f"h{n}", disk, 0.0, medium="disk")
        ).codes == [0]
    return a


def test_puts_go_to_memory_only_and_usage_is_per_medium() -> None:
    a = _pool()
    keys = [f"k{i}" for i in range(8)]
    r = a(PutStart(keys, [1000] * 8, ReplicateConfig(), 0.0))
    assert r.codes == [0] * 8
    assert {d.segment for reps in r.replicas for rep in reps for d in rep.slices} == {"m0"}
    a(PutEnd(keys, r.versions))
    # a put too large for memory is refused, never placed on the (larger) disk
    big = a(PutStart(["big"], [1 << 17], ReplicateConfig(), 0.0))
    assert big.codes != [0]
    one = ReplicateConfig(preferred_segment="m0.disk")  # a hint naming disk is ignored
    r2 = a(PutStart(["p"], [100], one, 0.0))
    assert [d.segment for d in r2.replicas[0][0].slices] == ["m0"]
    sm = a.sm
    mem, disk, both = sm.usage(), sm.usage("disk"), sm.usage(None)
    assert mem.capacity == 1 << 16 and disk.capacity == 1 << 20
    assert both.capacity == mem.capacity + disk.capacity
    assert mem.used == 8 * 1024 + 128 and disk.used == 0
    assert {s.name: s.medium for s in sm.segments()} == {"m0": "memory", "m0.disk": "disk"}


def test_mount_medium_is_checked_and_old_entries_are_memory() -> None:
    a = _SM()
    assert a(Mount("n", "s", "ep", "h", 4096, 0.0, medium="tape")).codes != [0]
    # an entry written before the field existed (no trailing medium) mounts memory
    old = msgspec.msgpack.encode(["mount", "n", "s", "ep", "h", 4096, 0.0, 0])
    a.i += 1
    assert a.sm.apply(a.i, old).codes == [0]
    assert a.sm.segments()[0].medium == "memory"


def test_snapshot_keeps_the_medium() -> None:
    a = _pool(nodes=2)
    clone = StoreStateMachine(CFG)
    clone.restore(a.sm.snapshot())
    assert [(s.name, s.medium) for s in clone.segments()] == [
        (s.name, s.medium) for s in a.sm.segments()
    ]
    assert clone.digest() == a.sm.digest()


# ---------------------------------------------------------------------- demotion


from kvmesh.store.errors import Code  # noqa: E402
from kvmesh.store.leader import Leader, LeaderConfig  # noqa: E402
from kvmesh.store.master import invariants  # noqa: E402
from kvmesh.store.master.commands import (  # noqa: E402
    Codes,
    DemoteEnd,
    DemoteRevoke,
    DemoteStart,
    DropReplica,
    Evict,
    ExpireNodes,
    Upsert,
)
from kvmesh.store.master.objects import TIER_DEMOTING, TIER_DISK, TIER_NONE  # noqa: E402
from kvmesh.store.tiering import DEMOTE_DEPTH  # noqa: E402

NE = int(Code.NOT_EVICTABLE)
NH = int(Code.NO_AVAILABLE_HANDLE)


def _checked(a: _SM, cmd):
    res = a(cmd)
    assert invariants.check(a.sm) == []
    clone = StoreStateMachine(CFG)
    clone.restore(a.sm.snapshot())  # every step survives a snapshot (the tier columns too)
    assert clone.digest() == a.sm.digest()
    return res


def _put(a: _SM, keys: list[str], size: int = 1000) -> list[int]:
    r = a(PutStart(keys, [size] * len(keys), ReplicateConfig(), 0.0))
    assert r.codes == [0] * len(keys)
    a(PutEnd(keys, r.versions))
    return list(r.versions)


def _segs(a: _SM, key: str) -> list[str]:
    (look,) = a.sm.lookup([key])
    return [d.segment for rep in look.replicas for d in rep.slices]


def test_demotion_lifecycle_memory_freed_only_after_the_disk_copy_is_complete() -> None:
    a = _pool(nodes=2)
    (v,) = _put(a, ["k"], 6000)  # two slices (slice_limit 4096)
    home = _segs(a, "k")[0]
    node = home[1:]  # m0 -> "0"
    used = a.sm.usage().used
    assert _checked(a, DemoteStart(["k"], [v])).codes == [0]
    assert a.sm.tier_of("k") == TIER_DEMOTING
    # while PROCESSING the disk copy is never returned, and the memory copy cannot go
    assert _segs(a, "k") == [home, home]
    assert a.sm.lookup_table(["k"]).crcs == []
    assert _checked(a, DropReplica(["k"], [v])).codes == [NE]
    assert _checked(a, DemoteStart(["k"], [v])).codes == [NE]  # one demotion at a time
    (task,) = a.sm.demote_tasks(f"n{node}", 10)
    assert a.sm.demote_tasks("n9", 10) == []
    assert [d.segment for d in task.dst.slices] == [f"{home}.disk"] * 2  # its own node's disk
    assert [d.segment for d in task.src.slices] == [home, home]
    # only the disk copy's node may end it, and only at the object's version
    assert _checked(a, DemoteEnd("n9", ["k"], [v], [7])).codes == [int(Code.INVALID_WRITE)]
    assert _checked(a, DemoteEnd(f"n{node}", ["k"], [v + 1], [7])).codes == [
        int(Code.INVALID_WRITE)
    ]
    assert _checked(a, DemoteEnd(f"n{node}", ["k"], [v], [7])).codes == [0]
    assert a.sm.tier_of("k") == TIER_DISK
    assert _segs(a, "k") == [home, home, f"{home}.disk", f"{home}.disk"]  # memory first
    assert a.sm.lookup_table(["x", "k"]).crcs == [-1, 7]
    r = _checked(a, DropReplica(["k"], [v]))
    assert r.codes == [0] and r.freed == used
    assert a.sm.usage().used == 0 and a.sm.usage("disk").used == used
    assert _segs(a, "k") == [f"{home}.disk"] * 2
    assert a.sm.exists(["k"]) == [True]
    assert _checked(a, DropReplica(["k"], [v])).codes == [NE]  # no memory copy left
    # disk eviction drops the disk-only object
    assert _checked(a, DropReplica(["k"], [v], medium="disk")).codes == [0]
    assert a.sm.exists(["k"]) == [False] and a.sm.usage("disk").used == 0


def test_single_slice_disk_only_objects_take_the_fast_lookups() -> None:
    a = _pool()
    keys = [f"k{i}" for i in range(20)]
    vs = _put(a, keys)
    assert _checked(a, DemoteStart(keys, vs)).codes == [0] * 20
    assert _checked(a, DemoteEnd("n0", keys, vs, list(range(20)))).codes == [0] * 20
    assert _checked(a, DropReplica(keys[:10], vs[:10])).codes == [0] * 10
    assert a.sm.lookup_table(keys[:1]).crcs == [0]  # one key
    t = a.sm.lookup_table(keys[:16])  # the column path
    assert t.crcs == list(range(16)) and len(t.rows) == 16 + 6
    assert a.sm.lookup_table(keys[10:]).crcs == list(range(10, 20))


def test_revoke_node_loss_and_upsert_of_a_demoted_object() -> None:
    a = _pool(nodes=2)
    vs = _put(a, ["a", "b", "c"])
    assert _checked(a, DemoteStart(["a", "b", "c"], vs)).codes == [0] * 3
    assert _checked(a, DemoteRevoke(["a"], [vs[0]])).codes == [0]
    assert a.sm.tier_of("a") == TIER_NONE and a.sm.exists(["a"]) == [True]
    nb = "n" + _segs(a, "b")[0][1:]
    assert _checked(a, DemoteEnd(nb, ["b"], [vs[1]], [1])).codes == [0]
    assert _checked(a, DropReplica(["b"], [vs[1]])).codes == [0]
    # an upsert of a disk-only object is placed anew in memory (never rewritten on disk)
    r = _checked(a, Upsert(["b"], [1000], ReplicateConfig(), 0.0))
    assert r.codes == [0] and a.sm.tier_of("b") == TIER_NONE
    assert [d.segment for d in r.replicas[0][0].slices][0] in ("m0", "m1")
    # the node goes: a demotion in flight goes with its memory copy
    assert _checked(a, ExpireNodes(["n" + _segs(a, "c")[0][1:]], 0.0)).codes == [0]
    assert a.sm.exists(["c"]) == [False]


def test_a_disk_only_object_survives_the_loss_of_its_memory_segment_only() -> None:
    a = _pool(nodes=2)
    (v,) = _put(a, ["k"])
    a(DemoteStart(["k"], [v]))
    a(DemoteEnd("n0", ["k"], [v], [5]))
    from kvmesh.store.master.commands import Unmount

    assert _checked(a, Unmount("n0", "m0", 0.0)).codes == [0]
    assert a.sm.exists(["k"]) == [True] and _segs(a, "k") == ["m0.disk"]
    assert a.sm.lookup_table(["k"]).crcs == [5]


def _leader(a: _SM, **kw) -> Leader:
    ld = Leader(LeaderConfig(**kw), a.sm, 0.0)
    ld.elected(0.0, a.i + 1, lambda: a.i, alone=True)
    return ld


def _run_tick(a: _SM, ld: Leader, now: float) -> list:
    out = []
    for cmd, done in ld.tick(now, now):
        res = a(cmd)
        assert invariants.check(a.sm) == []
        out.append((cmd, res))
        if done is not None:
            done(res)
    return out


def test_leader_demotes_instead_of_evicting_then_frees_memory_after_demote_end() -> None:
    a = _pool(mem=64 * 1024, disk=1 << 20)
    keys = [f"k{i:02d}" for i in range(60)]  # 60 KiB of 64: above the 90 % watermark
    vs = dict(zip(keys, _put(a, keys)))
    ld = _leader(a, demote_batch_bytes=1)  # evict_ratio batches: the pipeline's stop seen
    ld.touch(keys[30:])  # the first 30 are the oldest
    # a leased object is copied like the others (a lease forbids freeing, not reading), its
    # memory kept while the lease lasts
    ld.leases.grant(["k00"], 1.0, 5.0)
    started: list[str] = []
    t = 1.0
    while True:  # batches until the ones in flight bring memory under 85 % (the pipeline)
        steps = _run_tick(a, ld, t)
        t += 0.1
        if not steps:
            break
        # never an Evict; up to DEMOTE_DEPTH batches a tick, other keys each
        assert {type(c) for c, _ in steps} == {DemoteStart} and len(steps) <= DEMOTE_DEPTH
        for c, _ in steps:
            assert not set(c.keys) & set(started)
            started += c.keys
    assert started and "k00" in started and set(started) <= set(keys[:30])
    # 5 % batches (4 objects) until memory minus the demotions in flight is under 85 %
    assert (60 - len(started)) * 1024 < 0.85 * 64 * 1024 <= (64 - len(started)) * 1024
    tasks = a.sm.demote_tasks("n0", 100)
    assert sorted(t.key for t in tasks) == sorted(started)
    a(DemoteEnd("n0", [t.key for t in tasks], [t.version for t in tasks], [0] * len(tasks)))
    # memory is over its 90 % watermark: the oldest, now on disk, lose their memory copy --
    # but the leased one, and neither does eviction take it while its lease lasts
    drop = ld.tiers.drop_demoted(started, t)
    assert type(drop) is DropReplica and set(drop.keys) == set(started) - {"k00"}
    res = a(drop)
    ld.evicted(drop, res)
    assert res.codes == [0] * len(drop.keys) and ld.tiers.demoted_total == len(drop.keys)
    assert all(a.sm.exists([k]) == [True] for k in keys)
    assert a.sm.usage().used == (60 - len(started) + 1) * 1024
    assert all("k00" not in c.keys for c in ld.evictions(t, t, need=64 * 1024))
    assert {k: vs[k] for k in started} == {k: a.sm.version_of(k) for k in started}
    # below the watermark an ended demotion keeps its memory copy (both tiers serve it)
    assert ld.tiers.drop_demoted(started, t) is None


def _in_flight(a: _SM) -> int:
    objs = a.sm.objects
    return sum(a.sm.medium_bytes(objs[k], "memory") for k, _ in a.sm.demoting())


def test_a_demote_end_chains_the_next_batch_within_the_inflight_cap() -> None:
    a = _pool(mem=64 * 1024, disk=1 << 20)
    keys = [f"k{i:02d}" for i in range(60)]  # 60 KiB of 64 (1 KiB each once aligned)
    _put(a, keys)
    cap = 8 * 1024
    # demotion from half of memory: the cap, not the watermark, bounds the batches
    ld = _leader(a, demote_batch_bytes=4 * 1024, demote_inflight_bytes=cap, demote_watermark=0.5)
    # proposed and not yet applied counts too: a second batch, other keys, then the cap
    first = ld.tiers.demote_next(1.0, 1.0)
    second = ld.tiers.demote_next(1.0, 1.0)
    assert first is not None and second is not None and len(first.keys) == 4
    assert not set(first.keys) & set(second.keys)
    assert ld.tiers.demote_next(1.0, 1.0) is None  # 8 KiB proposed: the cap
    for ds in (first, second):
        ld.tiers.demote_started(ds, _checked(a, ds), 1.0)
    assert _in_flight(a) == cap and ld.tiers.demote_next(1.0, 1.0) is None
    # from here no tick: every end chains the next batch (the node's reply carries it)
    ended: list[str] = []
    t = 1.0
    while a.sm.demoting():
        k, v = a.sm.demoting()[0]
        end = DemoteEnd("n0", [k], [v], [1])
        res = _checked(a, end)
        ended.append(k)
        chain = ld.tiers.demote_ended(end, res, t, t)
        for cmd, done in chain:
            done(_checked(a, cmd))
        assert _in_flight(a) <= cap, "a chained DemoteStart passed demote_inflight_bytes"
        t += 0.01
    # memory over its watermark: each end also freed the ended keys' memory, and the chain
    # went on until the in-flight batches brought memory under demote_watermark
    assert len(ended) > 8 and len(set(ended)) == len(ended)
    assert all(a.sm.tier_of(k) == TIER_DISK for k in ended)
    assert a.sm.usage().used < 0.9 * 64 * 1024 and ld.tiers.demoted_total > 0
    assert ld.tiers.demote_next(t, t) is None  # nothing due: the pipeline stops by itself


def test_room_for_a_reservation_never_evicts_an_object_demotion_can_keep() -> None:
    """The live staged-demotion failure (test_e2e_tier_faults.py): memory full, one capped
    batch in flight, the other objects in memory only, and a writer's reservation refill
    asks for room. Only memory copies with a disk copy may go for it; an object in memory
    only is evicted for a put's own bytes (as documented) or when the disk is full."""
    a = _pool(mem=64 * 1024, disk=1 << 20)
    keys = [f"k{i:02d}" for i in range(62)]  # 62 KiB of 64
    _put(a, keys)
    ld = _leader(a, demote_batch_bytes=1024)
    ld.touch(keys)
    ds = ld.tiers.demote_next(1.0, 1.0)
    assert ds is not None and 0 < len(ds.keys) < len(keys)  # capped: not all of memory
    ld.tiers.demote_started(ds, _checked(a, ds), 1.0)
    only_memory = [k for k in keys if a.sm.tier_of(k) == TIER_NONE]
    assert only_memory
    # a reservation while the batch copies: nothing to free without losing an object
    assert ld.evictions(1.1, 1.1, need=8 * 1024, reserve=True) == []
    # the batch ends: its objects' memory may go for the reservation, nothing else
    tasks = a.sm.demote_tasks("n0", 100)
    _checked(
        a, DemoteEnd("n0", [t.key for t in tasks], [t.version for t in tasks], [0] * len(tasks))
    )
    cmds = ld.evictions(1.2, 1.2, need=8 * 1024, reserve=True)
    assert [type(c) for c in cmds] == [DropReplica] and set(cmds[0].keys) <= set(ds.keys)
    for c in cmds:
        ld.evicted(c, _checked(a, c))
    assert all(a.sm.exists([k]) == [True] for k in keys)
    # a put's own bytes: memory-only victims are evicted at once (demotion is too late)
    cmds = ld.evictions(1.3, 1.3, need=8 * 1024)
    assert Evict in [type(c) for c in cmds]
    for c in cmds:
        ld.evicted(c, None)  # not proposed: unblocked
    # a disk that answered NoSpace: a reservation evicts as without the tier
    ld.tiers._disk_full_until = 2.0
    assert Evict in [type(c) for c in ld.evictions(1.4, 1.4, need=8 * 1024, reserve=True)]


def test_leader_revokes_a_demotion_its_node_never_ends() -> None:
    a = _pool(mem=64 * 1024)
    keys = [f"k{i:02d}" for i in range(60)]
    _put(a, keys)
    ld = _leader(a, demote_timeout_s=5.0)
    first = _run_tick(a, ld, 1.0)
    assert first and {type(c) for c, _ in first} == {DemoteStart}
    started = [k for c, _ in first for k in c.keys]
    _run_tick(a, ld, 3.0)
    steps = _run_tick(a, ld, 6.5)
    # revoked (the disk bytes freed, memory kept), then tried again in the same turn
    assert [type(c) for c, _ in steps] == [DemoteRevoke] + [DemoteStart] * (len(steps) - 1)
    assert len(steps) > 1 and sorted(steps[0][0].keys) == sorted(started)
    assert steps[0][1].codes == [0] * len(started)


def test_a_reported_failed_demotion_is_revoked_and_its_disk_backs_off() -> None:
    """A node's DemoteEndReq.failed (its disk failed the writes: ENOSPC, EIO): the leader
    revokes only that node's own demotions in flight at their version, counts them, and
    places no demotion on that disk until its backoff passes (doubling per failure in a
    row, capped at demote_timeout_s; a COMPLETE end clears it). Another node's disk is used
    meanwhile; with no usable disk the objects wait in memory: the tick evicts no object
    in memory only for a backoff, even above the memory watermark."""
    a = _pool(mem=64 * 1024, disk=1 << 20, nodes=2)
    keys = [f"k{i:02d}" for i in range(120)]  # 120 KiB of 128: above the 90 % watermark
    _put(a, keys)
    ld = _leader(a, ticker_s=0.25, demote_timeout_s=5.0, demote_batch_bytes=1024)
    ds = ld.tiers.demote_next(1.0, 1.0)
    assert ds is not None and ds.avoid == []
    ld.tiers.demote_started(ds, _checked(a, ds), 1.0)
    mine = a.sm.demote_tasks("n0", 1000)
    theirs = a.sm.demote_tasks("n1", 1000)
    assert mine and theirs
    # n1 names n0's demotions, wrong versions, absent keys: none of it is revoked
    assert (
        ld.tiers.demote_failed("n1", [t.key for t in mine], [t.version for t in mine], 1.1) is None
    )
    bogus = ld.tiers.demote_failed("n0", [mine[0].key, "nope"], [mine[0].version + 1, 1], 1.1)
    assert bogus is None and ld.tiers.demote_failed_total == 0
    rv = ld.tiers.demote_failed(
        "n0", [t.key for t in mine + theirs], [t.version for t in mine + theirs], 1.1
    )
    assert type(rv) is DemoteRevoke and sorted(rv.keys) == sorted(t.key for t in mine)
    assert _checked(a, rv).codes == [0] * len(mine) and ld.tiers.demote_failed_total == len(mine)
    assert all(a.sm.tier_of(t.key) == TIER_NONE for t in mine)
    assert all(a.sm.tier_of(t.key) == TIER_DEMOTING for t in theirs)
    # n0's disk backs off 4 x ticker_s: the next batch avoids it, placed on n1's disk
    d0 = a.sm.by_name["m0.disk"]
    ds = ld.tiers.demote_next(1.2, 1.2)
    assert ds is not None and ds.avoid == [d0]
    ld.tiers.demote_started(ds, _checked(a, ds), 1.2)
    assert not set(ds.keys) & {t.key for t in a.sm.demote_tasks("n0", 1000)}
    assert ld.tiers.disk_room(1.2)  # a backoff is no full disk (eviction keeps memory-only objects)
    # (nor is NoSpace from the other disks while one was avoided)
    full = ld.tiers._disk_full_until
    ld.tiers.demote_started(DemoteStart(["x"], [1], avoid=[d0]), Codes([NH]), 1.2)
    assert ld.tiers._disk_full_until == full and ld.tiers.disk_room(1.2)
    # both disks back off: no batch; the tick evicts nothing in memory only
    theirs = a.sm.demote_tasks("n1", 1000)
    assert ld.tiers.demote_failed("n1", [t.key for t in theirs], [t.version for t in theirs], 1.3)
    _checked(a, DemoteRevoke([t.key for t in theirs], [t.version for t in theirs]))
    assert ld.tiers.demote_next(1.4, 1.4) is None
    assert a.sm.usage().used > 0.9 * a.sm.usage().capacity
    steps = _run_tick(a, ld, 1.4)
    assert Evict not in [type(c) for c, _ in steps], steps
    assert all(a.sm.exists([k]) == [True] for k in keys)
    # n0's backoff (1.1 + 1.0) is over first; a second failure in a row doubles it
    ds = ld.tiers.demote_next(2.2, 2.2)
    assert ds is not None and ds.avoid == [a.sm.by_name["m1.disk"]]
    ld.tiers.demote_started(ds, _checked(a, ds), 2.2)
    mine = a.sm.demote_tasks("n0", 1000)
    assert mine
    rv = ld.tiers.demote_failed("n0", [t.key for t in mine], [t.version for t in mine], 2.3)
    _checked(a, rv)
    assert ld.tiers._backing_off(4.2) == [d0] and ld.tiers._backing_off(4.4) == []
    # an end of n0's that makes a disk copy COMPLETE clears its backoff
    ds = ld.tiers.demote_next(4.4, 4.4)
    assert ds is not None
    ld.tiers.demote_started(ds, _checked(a, ds), 4.4)
    t0 = a.sm.demote_tasks("n0", 1)[0]
    ld.tiers._disk_backoff[d0] = (9.0, 3)
    assert _checked(a, DemoteEnd("n0", [t0.key], [t0.version], [1])).codes == [0]
    ld.tiers.disk_recovered("n0")
    assert d0 not in ld.tiers._disk_backoff


def test_leader_evicts_disk_only_objects_above_the_disk_watermark() -> None:
    a = _pool(mem=64 * 1024, disk=16 * 1024)
    keys = [f"k{i:02d}" for i in range(15)]
    vs = _put(a, keys)
    a(DemoteStart(keys, vs))
    a(DemoteEnd("n0", keys, vs, [0] * 15))
    a(DropReplica(keys, vs))
    ld = _leader(a)
    steps = _run_tick(a, ld, 1.0)
    assert [type(c) for c, _ in steps] == [Evict]
    assert a.sm.usage("disk").used < 0.9 * 16 * 1024


def test_without_disk_the_tick_evicts_as_before() -> None:
    a = _SM()
    a(Mount("n0", "m0", "ep", "h", 64 * 1024, 0.0))
    _put(a, [f"k{i:02d}" for i in range(60)])
    ld = _leader(a)
    assert [type(c) for c, _ in _run_tick(a, ld, 1.0)] == [Evict]


# ---------------------------------------------------------------------- the simulator


from kvmesh.store.master.sim import run_seed  # noqa: E402

SIM = {"duration": 10.0, "disk_size": 8192, "n_keys": 16}


def test_the_simulator_with_a_disk_tier_holds_its_invariants() -> None:
    results = [run_seed(seed, **SIM) for seed in range(2)]
    assert [r.violation for r in results if not r.ok] == []
    assert sum(r.demotions for r in results) > 0
    assert sum(r.disk_reads for r in results) > 0  # reads served by disk copies, bytes checked


def test_planted_memory_freed_before_the_disk_copy_is_complete_is_caught(monkeypatch) -> None:
    # (the first 16 seeds, two batches a decision and leased objects demoted: caught in all
    # but 2, 3, 8 and 15 by the invariant; 0, 1, 5, 6, 7 and 9 by the demotion-source check
    # without it)
    caught = [run_seed(seed, plant="early_free", **SIM) for seed in (0, 1, 9)]
    assert all(not r.ok and "freed too early" in r.violation for r in caught), caught
    # without the state invariant the behaviour shows it too: the memory a node is copying
    # from is freed under it
    import kvmesh.store.master.sim.checks as checks

    orig = checks.check_state
    monkeypatch.setattr(
        checks, "check_state", lambda sm: [e for e in orig(sm) if "freed too early" not in e]
    )
    caught = [run_seed(seed, plant="early_free", **SIM) for seed in (0, 1, 9)]
    assert all(not r.ok and "demotion source" in r.violation for r in caught), caught


# ---------------------------------------------------------------------- re-adoption

from kvmesh.store.master.commands import Adopt, Reclaim  # noqa: E402

ID = "ab" * 16
NF = int(Code.OBJECT_NOT_FOUND)


def _disk_pool(disk_id: str = ID) -> _SM:
    """Node n0: memory m0 and disk m0.disk (with a disk id); node n1: memory m1 only."""
    a = _SM()
    assert a(Mount("n0", "m0", "ep0", "h0", 1 << 16, 0.0)).codes == [0]
    assert a(Mount("n1", "m1", "ep1", "h1", 1 << 16, 0.0)).codes == [0]
    assert a(
        Mount("n0", "m0.disk", "ep0", "h0", 1 << 20, 0.0, medium="disk", disk_id=disk_id)
    ).codes == [0]
    return a


def _disk_only(a: _SM, keys: list[str]) -> list[int]:
    """Put ``keys`` on n0 and demote them to disk-only objects (crc i each)."""
    r = a(PutStart(keys, [1000] * len(keys), ReplicateConfig(preferred_segment="m0"), 0.0))
    assert r.codes == [0] * len(keys)
    a(PutEnd(keys, r.versions))
    vs = list(r.versions)
    assert all(s == "m0" for k in keys for s in _segs(a, k))
    assert _checked(a, DemoteStart(keys, vs)).codes == [0] * len(keys)
    assert _checked(a, DemoteEnd("n0", keys, vs, list(range(len(keys))))).codes == [0] * len(keys)
    assert _checked(a, DropReplica(keys, vs)).codes == [0] * len(keys)
    return vs


def _expire_offline(a: _SM, now: float = 0.0) -> None:
    assert _checked(a, ExpireNodes(["n0"], now, disk_offline_ttl=100.0)).codes == [0]
    assert {s.name: s.state for s in a.sm.segments()} == {"m1": "mounted", "m0.disk": "offline"}


def test_an_expired_nodes_disk_goes_offline_listed_but_unreadable() -> None:
    a = _disk_pool()
    keys = [f"k{i}" for i in range(20)]
    vs = _disk_only(a, keys)
    # a demotion in flight from n0's memory: it goes with that memory (lost)
    (vp,) = _put(a, ["p"])
    if _segs(a, "p")[0] == "m0":
        assert _checked(a, DemoteStart(["p"], [vp])).codes == [0]
    _expire_offline(a)
    assert a.sm.demoting() == [] and "p" not in a.sm.objects or _segs(a, "p") == ["m1"]
    # listed, but neither found nor counted present: nothing could read them
    assert len(a.sm.objects) >= 20 and a.sm.object_count() >= 20
    assert a.sm.exists(keys[:3]) == [False] * 3
    assert a.sm.exists_flags(keys[:2]) == [0, 0]
    assert a.sm.exists_codes("k", ["0", "1"], [""]) == [0, 0]
    assert a.sm.exists_leading("k", ["0"], [""]) == 0
    for ks in (keys[:1], keys[:3], keys):  # the one-key, loop and batch paths
        assert a.sm.lookup_table(ks).codes == [NF] * len(ks)
    # the liveness judge no longer hears about n0 (only its offline disk is left)
    assert a.sm.adoptable("n0", "m0.disk") == [
        (k, v, off, 1000, i) for i, (k, v, off) in enumerate(_disk_offsets(a, keys, vs))
    ]
    assert a.sm.adoptable("n9", "m0.disk") is None and a.sm.adoptable("n0", "m1") is None
    # an offline disk is not a place for new demotions, nor a reason to free memory
    (vq,) = _put(a, ["q"])
    assert _checked(a, DemoteStart(["q"], [vq])).codes == [int(Code.NO_AVAILABLE_HANDLE)]
    # a second expiry of n0 finds nothing (the offline disk waits for its node)
    assert _checked(a, ExpireNodes(["n0"], 1.0, disk_offline_ttl=100.0)).codes == [
        int(Code.CLIENT_NOT_FOUND)
    ]


def _disk_offsets(a: _SM, keys: list[str], vs: list[int]) -> list[tuple[str, int, int]]:
    return [(k, v, a.sm.disk_copy(k)[0][1]) for k, v in zip(keys, vs)]


def test_a_restart_with_the_same_disk_id_re_adopts_and_drops_the_bad_copies() -> None:
    a = _disk_pool()
    keys = [f"k{i}" for i in range(20)]
    vs = _disk_only(a, keys)
    _expire_offline(a)
    # the restarted node: a new node id and names, the same disk id
    assert _checked(a, Mount("n2", "m2", "ep2", "h2", 1 << 16, 5.0)).codes == [0]
    assert _checked(
        a, Mount("n2", "m2.disk", "ep2", "h2", 1 << 20, 5.0, medium="disk", disk_id=ID)
    ).codes == [0]
    disk = [s for s in a.sm.segments() if s.medium == "disk"]
    assert [(s.name, s.node_id, s.endpoint, s.state) for s in disk] == [
        ("m2.disk", "n2", "ep2", "offline")
    ]
    assert a.sm.exists(keys) == [False] * 20  # still unverified
    listed = a.sm.adoptable("n2", "m2.disk")
    assert [x[0] for x in listed] == keys
    # only the disk's node may adopt it, with its id
    assert _checked(a, Adopt("n1", "m2.disk", ID, [], [])).codes == [int(Code.SEGMENT_NOT_FOUND)]
    assert _checked(a, Adopt("n2", "m2.disk", "cd" * 16, [], [])).codes == [
        int(Code.SEGMENT_NOT_FOUND)
    ]
    # k3 failed its check; k4 is named at a stale version (kept: that is not its copy)
    assert _checked(a, Adopt("n2", "m2.disk", ID, ["k3", "k4"], [vs[3], vs[4] + 1])).codes == [0]
    assert a.sm.exists(keys) == [k != "k3" for k in keys]
    assert "k3" not in a.sm.objects
    t = a.sm.lookup_table(keys)
    assert t.codes == [NF if k == "k3" else 0 for k in keys]
    assert {n for n, _, _ in t.segments} == {"m2.disk"}
    assert [c for c in t.crcs if c >= 0] == [i for i in range(20) if i != 3]
    assert {s.name: s.state for s in a.sm.segments()}["m2.disk"] == "mounted"
    assert a.sm.usage("disk").used == 19 * 1024
    assert _checked(a, Adopt("n2", "m2.disk", ID, ["k5"], [vs[5]])).codes == [0]  # repeated
    assert a.sm.exists(["k5"]) == [True]
    # the old names stay quarantined; new demotions go to the adopted disk again
    assert _checked(a, Mount("n0", "m0.disk", "ep0", "h0", 1 << 20, 6.0, medium="disk")).codes == [
        int(Code.SEGMENT_ALREADY_EXISTS)
    ]


def test_a_restart_before_expiry_takes_the_disk_over_and_its_demotions_in_flight_go() -> None:
    a = _disk_pool()
    vs = _disk_only(a, ["d"])
    (vp,) = _put(a, ["p"])  # in m0 or m1; its demotion goes to the only disk
    assert _checked(a, DemoteStart(["p"], [vp])).codes == [0]
    assert _checked(
        a, Mount("n0b", "m0b.disk", "ep0b", "h0", 1 << 20, 1.0, medium="disk", disk_id=ID)
    ).codes == [0]
    assert a.sm.tier_of("p") == TIER_NONE and a.sm.exists(["p"]) == [True]  # memory kept
    assert [x[0] for x in a.sm.adoptable("n0b", "m0b.disk")] == ["d"]
    assert _checked(a, Adopt("n0b", "m0b.disk", ID, [], [])).codes == [0]
    assert a.sm.lookup_table(["d"]).crcs == [0] and vs


def test_another_disk_id_at_the_name_adopts_nothing_and_the_ttl_drops_an_unclaimed_disk() -> None:
    a = _disk_pool()
    keys = [f"k{i}" for i in range(5)]
    _disk_only(a, keys)
    _expire_offline(a)
    # the same name (a node with a stable id), a wiped id file: every listed copy goes
    assert _checked(
        a, Mount("n0", "m0.disk", "ep0", "h0", 1 << 20, 1.0, medium="disk", disk_id="cd" * 16)
    ).codes == [0]
    assert a.sm.exists(keys) == [False] * 5 and not any(k in a.sm.objects for k in keys)
    assert a.sm.usage("disk").used == 0
    assert {s.name: s.state for s in a.sm.segments()}["m0.disk"] == "mounted"
    # a disk whose node never comes back: dropped by the Reclaim past its deadline
    b = _disk_pool()
    _disk_only(b, keys)
    _expire_offline(b, now=10.0)
    assert _checked(b, Reclaim(109.0, 30.0)).unmounted == []
    r = _checked(b, Reclaim(111.0, 30.0))
    assert r.unmounted == ["m0.disk"] and sorted(r.lost) == keys
    assert not any(k in b.sm.objects for k in keys)
    # an entry from before re-adoption (no ttl) drops the disk as it did
    c = _disk_pool()
    _disk_only(c, keys)
    assert _checked(c, ExpireNodes(["n0"], 0.0)).codes == [0]
    assert [s.name for s in c.sm.segments()] == ["m1"] and len(c.sm.objects) == 0


def test_snapshots_keep_the_disk_id_and_old_images_are_unchanged() -> None:
    a = _disk_pool()
    _disk_only(a, ["x"])
    _expire_offline(a)
    clone = StoreStateMachine(CFG)
    clone.restore(a.sm.snapshot())
    (seg,) = [s for s in clone.segs.values() if s.medium == "disk"]
    assert (seg.disk_id, seg.state, seg.deadline) == (ID, "offline", 100.0)
    assert clone.exists(["x"]) == [False] and clone.adoptable("n0", "m0.disk")[0][0] == "x"
    # a disk without an id is recorded exactly as before the field existed (same fields,
    # same values); an id rides in the medium field
    import numpy as np

    from kvmesh.store.master.snapshot import _SegRec

    assert len(_SegRec.__struct_fields__) == 11
    none = np.zeros(0, np.int64)
    assert [r.medium for r in _pool().sm._header(0, none).segments] == ["memory", "disk"]
    assert [r.medium for r in a.sm._header(0, none).segments] == ["memory", f"disk/{ID}"]


# ---------------------------------------------------------------------- promotion on hit

from kvmesh.store.master.commands import (  # noqa: E402
    PromoteEnd,
    PromoteStart,
    Release,
    Remove,
)

IW = int(Code.INVALID_WRITE)


def _demoted(a: _SM, keys: list[str]) -> list[int]:
    """``keys`` put on n0 and demoted to disk-only objects (crc 100 + i)."""
    vs = _put(a, keys)
    assert _checked(a, DemoteStart(keys, vs)).codes == [0] * len(keys)
    crcs = [100 + i for i in range(len(keys))]
    assert _checked(a, DemoteEnd("n0", keys, vs, crcs)).codes == [0] * len(keys)
    assert _checked(a, DropReplica(keys, vs)).codes == [0] * len(keys)
    assert all(_segs(a, k) == ["m0.disk"] for k in keys)
    return vs


def test_promotion_on_hit_fills_a_reserved_memory_copy_and_keeps_the_disk_copy() -> None:
    a = _pool(mem=64 * 1024, disk=1 << 20, nodes=1)
    keys = ["a", "b", "c"]
    vs = _demoted(a, keys)
    ld = _leader(a, promote_hits=2, demote_timeout_s=5.0)
    ld.touch(["a", "b"])
    assert [type(c) for c, _ in _run_tick(a, ld, 1.0)] == []  # one read each: not yet
    ld.touch(["a", "b"])
    ((cmd, res),) = _run_tick(a, ld, 1.1)
    assert type(cmd) is PromoteStart and cmd.keys == ["a", "b"] and res.codes == [0, 0]
    tag = res.tag
    # reserved, not in the object: lookups still serve the disk copy alone, with its crc
    assert tag in a.sm.reserved and a.sm.usage().reserved_bytes == 2 * 1024
    assert _segs(a, "a") == ["m0.disk"] and a.sm.lookup_table(["a"]).crcs == [100]
    tasks = {t.key: t for t in ld.tiers.promote_tasks("n0", 10)}
    assert ld.tiers.promote_tasks("n9", 10) == [] and sorted(tasks) == ["a", "b"]
    ta = tasks["a"]
    assert (ta.tag, ta.version, ta.crc) == (tag, vs[0], 100)
    assert ta.src.slices[0].segment == "m0.disk" and ta.dst.slices[0].segment == "m0"
    off = ta.dst.slices[0].offset
    # only the disk's node, only inside the reservation, only at the version
    assert _checked(a, PromoteEnd("n9", tag, ["a"], [vs[0]], ["m0"], [off])).codes == [IW]
    assert _checked(a, PromoteEnd("n0", tag, ["a"], [vs[0]], ["m0"], [off + 64])).codes == [IW]
    assert _checked(a, PromoteEnd("n0", tag, ["a"], [vs[0] + 1], ["m0"], [off])).codes == [IW]
    # the leader passes only ends of its own promotions, as it started them
    assert (
        ld.tiers.plan_promote_end(PromoteEnd("n0", tag + 1, ["a"], [vs[0]], ["m0"], [off])).keys
        == []
    )
    assert (
        ld.tiers.plan_promote_end(PromoteEnd("n0", tag, ["a"], [vs[0]], ["m0"], [off + 64])).keys
        == []
    )
    assert (
        ld.tiers.plan_promote_end(PromoteEnd("n9", tag, ["a"], [vs[0]], ["m0"], [off])).keys == []
    )
    end = ld.tiers.plan_promote_end(PromoteEnd("n0", tag, ["a"], [vs[0]], ["m0"], [off]))
    assert end.keys == ["a"]
    r = _checked(a, end)
    ld.tiers.promote_ended(end, r)
    assert r.codes == [0] and ld.tiers.promoted_total == 1
    # memory first, the disk copy kept (its crc still checked), memory free to drop again
    assert _segs(a, "a") == ["m0", "m0.disk"] and a.sm.tier_of("a") == TIER_DISK
    assert a.sm.lookup_table(["a"]).crcs == [100]
    assert a.sm.usage().used == 2048 and a.sm.usage().reserved_bytes == 1024  # + b reserved
    assert _checked(a, PromoteEnd("n0", tag, ["a"], [vs[0]], ["m0"], [off])).codes == [IW]
    # b is removed while its promotion is in flight: its end is refused and its memory
    # stays reserved (the node may still be writing it) until the reservation's release
    assert _checked(a, Remove(["b"])).codes == [0]
    tb = tasks["b"]
    rb = _checked(a, PromoteEnd("n0", tag, ["b"], [vs[1]], ["m0"], [tb.dst.slices[0].offset]))
    assert rb.codes == [int(Code.OBJECT_NOT_FOUND)] and tag in a.sm.reserved
    # the hold (demote_timeout_s) runs out: the tick releases it
    steps = _run_tick(a, ld, 6.5)
    assert [type(c) for c, _ in steps] == [Release] and steps[0][0].tags == [tag]
    assert tag not in a.sm.reserved and a.sm.usage().reserved_bytes == 0
    assert ld.tiers.promote_tasks("n0", 10) == []
    # c, never read twice, was never promoted; a promotion that lapses leaves the object
    # on disk, readable
    assert _segs(a, "c") == ["m0.disk"]
    (r2,) = [r for c, r in _run_tick(a, ld, 7.0) if type(c) is PromoteStart] or [None]
    assert r2 is None


def test_promotion_only_into_memory_below_the_demotion_watermark() -> None:
    a = _pool(mem=64 * 1024, disk=1 << 20, nodes=1)
    vs = _demoted(a, ["x"])
    _put(a, [f"f{i:02d}" for i in range(56)])  # 56 KiB of 64: over 85 %
    ld = _leader(a, promote_hits=1)
    ld.touch(["x"])
    assert ld.tiers.promotion(1.0) is None  # it would be demoted again at once
    assert _checked(a, PromoteStart(["x"], [vs[0] + 1])).codes == [NE]  # version checked


def test_the_simulator_with_promotion_on_hit_holds_its_invariants() -> None:
    # (seeds 0 and 2 promote: memory is often over the demotion watermark, where it waits)
    results = [run_seed(seed, promote_hits=1, **SIM) for seed in (0, 2)]
    assert [r.violation for r in results if not r.ok] == []
    assert sum(r.promotions for r in results) > 0


# ---------------------------------------------------------------------- write-through


def test_write_through_gives_every_object_a_disk_copy_and_keeps_its_memory() -> None:
    a = _pool(mem=64 * 1024, disk=1 << 20)
    keys = [f"k{i}" for i in range(4)]  # 4 KiB of 64: far under any watermark
    _put(a, keys)
    assert _run_tick(a, _leader(a), 1.0) == []  # offload on evict: nothing to do yet
    ld = _leader(a, write_through=True)
    ((cmd, res),) = _run_tick(a, ld, 1.0)
    assert type(cmd) is DemoteStart and sorted(cmd.keys) == keys and res.codes == [0] * 4
    tasks = a.sm.demote_tasks("n0", 10)
    end = DemoteEnd("n0", [t.key for t in tasks], [t.version for t in tasks], [7] * 4)
    r = _checked(a, end)
    # memory is under its watermark: the memory copies stay, nothing more is due
    assert [type(c) for c, _ in ld.tiers.demote_ended(end, r, 1.1, 1.1)] == []
    assert all(_segs(a, k) == ["m0", "m0.disk"] for k in keys)
    assert a.sm.usage().used == 4 * 1024 and _run_tick(a, ld, 1.2) == []
    # a new put gets its disk copy at the next chance (a tick, or a node asking for work)
    _put(a, ["new"])
    ((ds, _),) = ld.tiers.demote_asked(1.3, 1.3)
    assert ds.keys == ["new"]


def test_demotion_and_eviction_walks_skip_disk_only_objects_in_one_pass(monkeypatch) -> None:
    """The oldest objects are disk-only once demotion kept up: the victim walk leaves them
    out in one vectorised pass (``no_memory_to_free``), not one ``evict_info`` each, so a
    decision costs the memory's objects, not the disk's (counted calls, no clock)."""
    a = _pool(mem=64 * 1024, disk=4 << 20)
    for lo in range(0, 2000, 50):  # 2,000 disk-only objects, the oldest
        ks = [f"d{i}" for i in range(lo, lo + 50)]
        vs = _put(a, ks)
        a(DemoteStart(ks, vs))
        a(DemoteEnd("n0", ks, vs, [0] * len(ks)))
        a(DropReplica(ks, vs))
    mem = [f"m{i:02d}" for i in range(60)]
    _put(a, mem)
    ld = _leader(a, evict_ratio=0.25)
    calls = 0
    real = a.sm.evict_info

    def counted(key, medium=None):
        nonlocal calls
        calls += 1
        return real(key, medium)

    monkeypatch.setattr(a.sm, "evict_info", counted)
    ds = ld.tiers.demote_next(1.0, 1.0)
    assert ds is not None and set(ds.keys) <= set(mem)
    cmds = ld.evictions(1.0, 1.0, need=8 * 1024)
    assert cmds and all(set(c.keys) <= set(mem) for c in cmds)
    assert calls <= 2 * len(mem), f"{calls} evict_info calls for {len(mem)} objects in memory"
