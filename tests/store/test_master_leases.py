"""Leader soft state: leases, access order, heartbeats, eviction choice, the lease policy."""

from __future__ import annotations

from kvmesh.store.errors import Code
from kvmesh.store.master.commands import (
    Mount,
    Pin,
    PutEnd,
    PutStart,
    Remove,
    Upsert,
    encode_command,
)
from kvmesh.store.master.eviction import choose_victims
from kvmesh.store.master.leases import AccessStamps, AccessStats, HeartbeatTable, LeaseTable
from kvmesh.store.master.policy import (
    HoldTracker,
    PutAges,
    plan_remove,
    plan_remove_prefix,
    plan_upsert,
)
from kvmesh.store.master.state import MasterConfig, StoreStateMachine
from kvmesh.store.types import ReplicateConfig


def test_lease_table_grants_expires_and_blocks() -> None:
    t = LeaseTable()
    assert t.grant(["a", "b"], 10.0, 5.0) == [15.0, 15.0]
    assert t.leased("a", 14.9) and not t.leased("a", 15.0)
    t.grant(["a"], 8.0, 5.0)  # an earlier expiry never shortens a lease
    assert t.expiry("a") == 15.0
    t.block(["b"])
    t.block(["b"])
    assert t.grant(["b"], 11.0, 5.0) == [0.0]
    t.unblock(["b"])
    assert t.blocked("b")
    t.unblock(["b"])
    assert not t.blocked("b") and t.grant(["b"], 11.0, 5.0) == [16.0]
    assert sorted(t.all_leased(15.5)) == ["b"]
    assert t.purge(20.0) >= 1 and len(t) == 0


def test_new_leader_treats_everything_as_leased_for_one_period() -> None:
    t = LeaseTable(start=100.0, grace=5.0)
    assert t.leased("never-seen", 104.9)
    assert not t.leased("never-seen", 105.0)
    assert t.expiry("x") == 105.0


def test_heartbeats_and_access_order() -> None:
    hb = HeartbeatTable()
    hb.reset(["n1", "n2"], 0.0)
    hb.beat("n1", 8.0)
    hb.beat("n1", 3.0)  # late, out-of-order beats do not move time back
    assert hb.expired(10.5, 10.0) == ["n2"]
    hb.forget(["n2"])
    assert hb.expired(30.0, 10.0) == ["n1"] and hb.last("n1") == 8.0
    st = AccessStats()
    st.reset(["a", "b", "c"])
    st.touch(["a"])
    assert list(st.oldest()) == ["b", "c", "a"]
    st.forget(["c"])
    assert list(st.oldest()) == ["b", "a"] and "a" in st and len(st) == 2


def _filled(n: int = 10, size: int = 1000) -> StoreStateMachine:
    sm = StoreStateMachine(MasterConfig(align=8))
    sm.apply(1, encode_command(Mount("n", "s", "e", "h", n * size, 0.0)))
    keys = [f"k{i}" for i in range(n)]
    sm.apply(2, encode_command(PutStart(keys, [size] * n, ReplicateConfig(), 0.0)))
    sm.apply(3, encode_command(PutEnd(keys, [2] * n)))
    return sm


def test_choose_victims_oldest_first_skipping_leased_and_pinned() -> None:
    sm = _filled()
    leases = LeaseTable()
    stats = AccessStats()
    stats.reset(sm.keys())
    stats.touch(["k0", "k1"])  # now the youngest
    leases.grant(["k2"], 0.0, 5.0)
    sm.apply(4, encode_command(Pin(["k3"], True, 0.0)))
    sm.apply(5, encode_command(Pin(["k4"], False, 0.0, ttl=100.0)))
    plan = choose_victims(sm, leases, stats, 1.0, high_watermark=0.9, evict_ratio=0.2)
    assert plan.keys == ["k5", "k6"] and not plan.allow_soft
    assert plan.skipped_leased == 1 and plan.skipped_pinned == 1
    assert plan.versions == [2, 2] and plan.bytes == 2000
    # below the watermark: nothing, unless a put asked for space
    sm.apply(6, encode_command(Remove(["k9"])))
    assert choose_victims(sm, leases, stats, 1.0, high_watermark=0.95).keys == []
    assert choose_victims(sm, leases, stats, 1.0, high_watermark=0.95, need=1).keys == ["k5"]


def test_soft_pinned_victims_only_when_needed() -> None:
    sm = _filled(n=3)
    sm.apply(4, encode_command(Pin(["k0", "k1", "k2"], False, 0.0, ttl=100.0)))
    stats = AccessStats()
    stats.reset(sm.keys())
    plan = choose_victims(sm, LeaseTable(), stats, 1.0, need=500)
    assert plan.keys == ["k0"] and plan.allow_soft
    later = choose_victims(sm, LeaseTable(), stats, 200.0, need=500)  # pins expired
    assert later.keys == ["k0"] and not later.allow_soft


def test_plan_remove_and_upsert_follow_leases() -> None:
    leases = LeaseTable()
    leases.grant(["a"], 0.0, 5.0)
    p = plan_remove(leases, ["a", "b"], 1.0)
    assert p.codes == [Code.OBJECT_HAS_LEASE, 0] and p.command == Remove(["b"])
    f = plan_remove(leases, ["a", "b"], 1.0, force=True)
    assert f.codes == [0, 0] and f.command == Remove(["a", "b"], force=True, hold=True)
    assert f.release_at == 5.0
    assert plan_remove(leases, ["a"], 1.0).command is None
    up = Upsert(["a", "b", "c"], [1, 2, 3], ReplicateConfig(), 1.0)
    u = plan_upsert(leases, [True, True, False], up, 1.0)
    assert u.codes == [Code.OBJECT_HAS_LEASE, 0, 0]
    assert u.command is not None and u.command.keys == ["b", "c"] and u.command.sizes == [2, 3]


def test_hold_tracker() -> None:
    leases = LeaseTable(start=0.0, grace=5.0)
    h = HoldTracker(ttl=5.0)
    h.note(7, 3.0)
    assert h.due([7], leases, 4.0) is None  # the blanket period is not over
    assert h.due([7], leases, 5.0).tags == [7]
    assert h.due([9], leases, 6.0) is None  # unknown: first seen now
    assert h.due([9], leases, 10.9) is None
    assert h.due([7, 9], leases, 11.0).tags == [7, 9]
    h.forget([7, 9])
    assert h.due([], leases, 20.0) is None


def test_put_ages_run_on_the_leaders_clock_only() -> None:
    """A put is stale ``timeout`` after this leader first saw it (never by the wall time it
    carries); a new leader (a fresh PutAges) gives every put in flight a full timeout;
    finished puts are forgotten; a re-put of the key (new version) starts anew."""
    ages = PutAges()
    assert ages.stale([("a", 5), ("b", 6)], now=100.0, timeout=10.0) == []
    assert ages.stale([("a", 5), ("b", 6)], now=105.0, timeout=10.0) == []
    assert ages.stale([("a", 5), ("c", 9)], now=110.0, timeout=10.0) == [("a", 5)]
    assert len(ages) == 2  # b finished: forgotten
    assert ages.stale([("a", 7), ("c", 9)], now=119.0, timeout=10.0) == []  # a re-put
    assert ages.stale([("a", 7), ("c", 9)], now=120.0, timeout=10.0, limit=1) == [("c", 9)]
    successor = PutAges()  # a new leader: no history, a full timeout from its first look
    assert successor.stale([("a", 7), ("c", 9)], now=500.0, timeout=10.0) == []
    assert successor.stale([("a", 7), ("c", 9)], now=510.0, timeout=10.0) == [("a", 7), ("c", 9)]


def test_plan_remove_prefix_follows_the_remove_rules() -> None:
    leases = LeaseTable()
    leases.grant(["p/b"], now=0.0, ttl=5.0)
    cmd, at = plan_remove_prefix("p/", ["p/a", "p/b"], 2, True, leases, now=1.0)
    assert (cmd.keys, cmd.skipped, cmd.more, cmd.hold, at) == (["p/a"], 3, True, False, 0.0)
    cmd, at = plan_remove_prefix("p/", ["p/a", "p/b"], 0, False, leases, now=1.0, force=True)
    assert (cmd.keys, cmd.skipped, cmd.hold, at) == (["p/a", "p/b"], 0, True, 5.0)
    fresh = LeaseTable(start=0.0, grace=5.0)  # a new leader: everything leased for a while
    cmd, _ = plan_remove_prefix("p/", ["p/a"], 0, False, fresh, now=1.0)
    assert cmd.keys == [] and cmd.skipped == 1


def test_access_stats_touch_matches_the_per_key_moves() -> None:
    """The batch forms of ``touch`` (all new keys; some known) leave exactly the order of
    the one-key-at-a-time moves."""
    import random

    rng = random.Random(5)
    for _ in range(200):
        fast, slow = AccessStats(), AccessStats()
        base = [f"k{i}" for i in rng.sample(range(60), rng.randint(0, 40))]
        fast.reset(base)
        slow.reset(base)
        for _ in range(5):
            batch = [f"k{i}" for i in rng.sample(range(80), rng.randint(1, 20))]
            if rng.random() < 0.2:
                batch.append(batch[0])  # a repeated key: the per-key loop
            fast.touch(batch)
            for k in batch:  # the reference: one move per key
                slow.touch(iter([k]))
            assert list(fast.oldest()) == list(slow.oldest())


def test_access_stamps_evict_oldest_first_like_the_dict() -> None:
    """The leader's stamp column gives the victims of the dict order in the same case."""
    sm = _filled()
    leases = LeaseTable()
    stats = AccessStamps(sm)
    stats.reset()
    stats.touch(["k0", "k1"])  # now the youngest
    leases.grant(["k2"], 0.0, 5.0)
    sm.apply(4, encode_command(Pin(["k3"], True, 0.0)))
    sm.apply(5, encode_command(Pin(["k4"], False, 0.0, ttl=100.0)))
    plan = choose_victims(sm, leases, stats, 1.0, high_watermark=0.9, evict_ratio=0.2)
    assert plan.keys == ["k5", "k6"] and plan.skipped_leased == 1 and plan.skipped_pinned == 1
    sm.apply(6, encode_command(Remove(["k5", "k9"])))  # freed rows are skipped
    assert list(stats.oldest()) == ["k2", "k3", "k4", "k6", "k7", "k8", "k0", "k1"]
    assert len(stats) == 8 and "k0" in stats and "k5" not in stats
    stats.reset()  # a new leader: all equally old again, in row order
    assert list(stats.oldest())[:2] == ["k0", "k1"]


def test_stamp_order_is_stamp_then_row_across_passes() -> None:
    """``oldest_rows`` in passes (``first`` small) yields exactly the (stamp, row) order of
    the live rows, each once, also after the clock is renumbered."""
    import random

    rng = random.Random(7)
    for trial in range(30):
        sm = _filled(n=rng.randint(1, 300), size=8)
        t = sm.objects
        keys = list(t.key_list())
        for _ in range(rng.randint(0, 20)):
            t.touch(rng.sample(keys, rng.randint(1, len(keys))) + ["absent"])
        if trial % 3 == 0:
            t._renumber()
        gone = rng.sample(keys, len(keys) // 4)
        sm.apply(9, encode_command(Remove(gone)))
        want = sorted((int(t.stamp[r]), r) for r in range(t.n) if t.size[r])
        assert list(t.oldest_rows(first=rng.randint(1, 8))) == [r for _, r in want]
