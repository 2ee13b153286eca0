"""A call's shm jobs in one pass (``ShmTransport.execute_many``) and the fence entries it takes
for all its regions at once (``FenceClient.enter_many``/``leave_many``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvmesh.transfer import Op, TransportKind, fence
from kvmesh.transfer.errors import SegmentNotFound, TransferTimeout
from kvmesh.transfer.memory import SharedBuffer
from kvmesh.transfer.transports.shm import ShmTransport

PAGE = 8192


def test_many_pairs_in_one_pass_land_every_byte(make_engine, monkeypatch):
    owner, client = make_engine(), make_engine(transport="shm")
    bufs = [SharedBuffer.create(64 * PAGE) for _ in range(6)]
    for i, b in enumerate(bufs):
        owner.register(b.array(), name=f"r{i}")
    srcs = [np.random.default_rng(i).integers(0, 256, 32 * PAGE, dtype=np.uint8) for i in range(3)]
    for s in srcs:
        client.register(s)
    # the single-job path must not run: every pair goes through the one pass
    monkeypatch.setattr(ShmTransport, "execute", lambda self, job: pytest.fail("per-job path"))
    rng = np.random.default_rng(7)
    local, remote, want = [], [], []
    for k, (si, ri) in enumerate(itertools.product(range(3), range(6))):
        for j in range(2):  # two scattered pages per pair, one an odd length
            n = PAGE if j == 0 else PAGE - 24
            lo = (2 * ri + j) * PAGE + int(rng.integers(0, 24))  # disjoint in each source
            ro = (2 * k + j) * PAGE + (8 if j else 0)
            local.append(srcs[si].ctypes.data + lo)
            remote.append(bufs[ri].addr + ro)
            want.append((ri, ro, srcs[si][lo : lo + n].copy()))
    lens = [len(w[2]) for w in want]
    res = client.transfer_by_address(Op.WRITE, owner.address, local, remote, lens)
    assert res.transports == [TransportKind.SHM] and res.nbytes == sum(lens)
    for ri, ro, data in want:
        assert (bufs[ri].array()[ro : ro + len(data)] == data).all()
    # and back: READ into zeroed sources
    for s in srcs:
        s[:] = 0
    client.transfer_by_address(Op.READ, owner.address, local, remote, lens)
    for (_, _, data), p in zip(want, local):
        s = next(s for s in srcs if s.ctypes.data <= p < s.ctypes.data + s.nbytes)
        off = p - s.ctypes.data
        assert (s[off : off + len(data)] == data).all()


def _fenced(n: int) -> tuple[fence.FenceClient, list[int]]:
    ids = [10_000 + i for i in range(n)]  # far from the ids of live regions
    name = None
    for rid in ids:
        name = fence.publish(rid)
    assert name is not None
    return fence.FenceClient(name), ids


def test_enter_many_counts_per_region_and_a_refusal_leaves_nothing_held():
    fc, (a, b, c) = _fenced(3)
    fc.enter_many([(a, "a"), (b, "b")])
    fc.enter_many([(a, "a")])  # a second job inside a
    fc.leave_many([a])
    with pytest.raises(TransferTimeout):
        fence.revoke(a, timeout=0.05)  # still held by the first entry
    fc.leave_many([a, b])
    assert not fc._held
    fence.revoke(a, timeout=1.0)  # both entries gone: the owner gets it at once
    # b is free; c is revoked: an entry naming all three fails on c and leaves b and a unheld
    fence.revoke(c, timeout=1.0)
    with pytest.raises(SegmentNotFound, match="'c'"):
        fc.enter_many([(b, "b"), (c, "c")])
    assert not fc._held
    fence.revoke(b, timeout=1.0)
