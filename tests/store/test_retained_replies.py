"""A master keeps nothing batch-sized alive once a request is answered.

Each put batch makes per-key lists (planned codes, the applied result's codes). If the master
holds them after the reply (a proposal's future kept until its deadline, a retry plan kept as
a list), thousands of them accumulate under load, and every pass of the cyclic GC walks all of
their references with the event loop stopped: 80-90 ms holds at 10 M keys (docs/store-master.md,
"Event-loop stalls"). The test puts batches on a live embedded master and counts the
batch-sized lists still alive afterwards; it must not grow with the number of batches."""

from __future__ import annotations

import gc

from kvmesh.store import protocol as P
from kvmesh.store.embedded_master import EmbeddedMaster
from kvmesh.store.rpc import MasterClient
from kvmesh.store.types import ReplicateConfig

BATCH = 1500  # larger than any list the master keeps for other reasons in this test


def _batch_lists() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is list and len(o) >= BATCH)


def _put_batch(rpc: MasterClient, keys: list[str], cfg: ReplicateConfig) -> None:
    ps = rpc.mutate(lambda rid, s: P.PutStartReq(rid, s, keys, [4096] * len(keys), cfg))
    pe = rpc.mutate(lambda rid, s: P.PutEndReq(rid, s, keys, ps.versions))
    assert not any(pe.codes), pe.codes[:3]


def test_answered_put_batches_leave_no_batch_sized_lists_behind():
    m = EmbeddedMaster()
    rpc = MasterClient([m.address], m.security, node_id="n1", timeout=30)
    try:
        rpc.mutate(lambda rid, s: P.MountReq(rid, s, "n1", "seg", "127.0.0.1:1", "h", 1 << 40))
        cfg = ReplicateConfig()
        before = _batch_lists()
        batches = 40
        for b in range(batches):
            _put_batch(rpc, [f"k-{b}-{i:05d}" for i in range(BATCH)], cfg)
        kept = _batch_lists() - before
        # A few may belong to the last request (the client's last reply, the index's
        # selection buffers); anything kept per answered batch would be >= 40.
        assert kept <= 8, f"{kept} batch-sized lists alive after {batches} answered batches"
    finally:
        rpc.close()
        m.stop()


def test_a_kept_plan_gives_a_retry_the_first_attempts_answers():
    """Plans are kept compact (a count of zeros, or an int32 array when something was
    refused): a retry of the same (client, seq) must still get the first attempt's per-key
    answers and hold release time back, without planning again."""
    from collections import OrderedDict
    from types import SimpleNamespace

    from kvmesh.store.handlers import Handlers

    h = SimpleNamespace(_plans=OrderedDict())
    calls = []

    def plan(codes, release_at):
        def make():
            calls.append(1)
            return list(codes), release_at

        return make

    refused = [0, -706, 0, -704, -(2**31)]
    for sess, codes, rel in (
        (P.Session(7, 1, 0), refused, 12.5),
        (P.Session(7, 2, 0), [0] * 5, 0.0),
    ):
        first = Handlers._planned(h, sess, plan(codes, rel))
        again = Handlers._planned(h, sess, plan([1] * 5, 99.0))  # must not be called
        assert first == again == (codes, rel)
        assert type(again[0]) is list
    assert len(calls) == 2
