"""TransferEngine in one process: batches, bad input, threads, tensors, segments, accessor."""

import threading
import time

import numpy as np
import pytest
import torch

from kvmesh.transfer import (
    BatchState,
    BatchStateError,
    EngineClosed,
    InvalidArgument,
    InvalidLength,
    NotRegistered,
    Op,
    OutOfBounds,
    RequestStatus,
    SegmentExists,
    SegmentNotFound,
    TensorMismatch,
    TransferEngine,
    TransferError,
    TransportKind,
    get_engine,
    init_engine,
    shutdown_engine,
)
from kvmesh.transfer.transports import tcp

MiB = 1 << 20


@pytest.fixture
def pair(make_engine):
    """Two engines in this process; ``b`` publishes a 4 MiB shared segment 'pool'."""
    a, b = make_engine(node_id="a"), make_engine(node_id="b")
    seg_region = b.alloc_shared(4 * MiB, name="pool")
    seg_region.array()[:] = np.random.default_rng(1).integers(0, 256, 4 * MiB, dtype=np.uint8)
    local = a.register(np.zeros(4 * MiB, np.uint8))
    return a, b, seg_region, local, a.open_segment(b.address, "pool")


def test_read_write_and_transport_report(pair):
    a, b, seg, local, rs = pair
    res = a.read(local, 0, rs, 0, 4 * MiB)
    assert res.state is BatchState.DONE and res.transports == [TransportKind.LOCAL]
    assert res.nbytes == 4 * MiB and res.failed == 0
    assert (local.array() == seg.array()).all()
    before = seg.array().copy()
    local.array()[:] = 7
    a.write(local, 100, rs, 1000, 5000)
    assert (seg.array()[1000:6000] == 7).all()
    assert (seg.array()[:1000] == before[:1000]).all() and (
        seg.array()[6000:] == before[6000:]
    ).all()
    assert rs.transports() == {"dram": "local"}


def test_batch_of_many_pages_in_both_directions(pair):
    a, b, seg, local, rs = pair
    page, n = 4096, 1024
    rng = np.random.default_rng(5)
    src_pages = rng.permutation(n)
    dst_pages = rng.permutation(n)
    with a.batch() as bt:
        idx = bt.add_many(Op.READ, local, dst_pages * page, rs, src_pages * page, page)
        assert idx == range(0, n)
        assert bt.poll() is BatchState.OPEN and len(bt) == n
        bt.submit()
        res = bt.wait()
        assert res.state is BatchState.DONE and res.requests == n
        assert (bt.status() == RequestStatus.DONE).all()
    l2, s2 = local.array().reshape(n, page), seg.array().reshape(n, page)
    assert (l2[dst_pages] == s2[src_pages]).all()
    # WRITE them back somewhere else, mixed with single adds, in one batch
    local.array()[:] = np.random.default_rng(9).integers(0, 256, 4 * MiB, dtype=np.uint8)
    with a.batch() as bt:
        bt.add(Op.WRITE, local, 0, rs, 10, 3)
        bt.add_many("write", local, [page, 3 * page], rs, [2 * page, 5 * page], [page, 2 * page])
        bt.add(Op.READ, local, 8 * page, rs, 0, 16)
        bt.submit().wait()
        assert bt.status().tolist() == [RequestStatus.DONE] * 4
    s = seg.array()
    assert (s[10:13] == local.array()[:3]).all()
    assert (s[2 * page : 3 * page] == local.array()[page : 2 * page]).all()
    assert (s[5 * page : 7 * page] == local.array()[3 * page : 5 * page]).all()
    assert (local.array()[8 * page : 8 * page + 16] == s[:16]).all()


def test_large_batch_split_into_parallel_parts(make_engine):
    a, b = make_engine(split_bytes=2 * MiB), make_engine()
    seg = b.alloc_shared(32 * MiB, name="big")
    src = np.random.default_rng(2).integers(0, 256, 32 * MiB, dtype=np.uint8)
    local = a.register(src)
    rs = a.open_segment(b.address, "big")
    offs = np.arange(32, dtype=np.int64) * MiB
    with a.batch() as bt:
        bt.add_many(Op.WRITE, local, offs, rs, offs[::-1], MiB)
        bt.submit()
        assert len(bt._tasks) == 16  # cut at request boundaries into split_bytes parts
        bt.wait()
    assert (seg.array().reshape(32, MiB)[::-1] == src.reshape(32, MiB)).all()
    res = a.transfer(Op.READ, local, offs, rs, offs, MiB)  # sync path, split too
    assert res.nbytes == 32 * MiB and (local.array() == seg.array()).all()


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((0, 0, 0), InvalidLength, "positive"),
        ((0, 0, -5), InvalidLength, "positive"),
        ((-1, 0, 10), OutOfBounds, "negative"),
        ((0, -4096, 10), OutOfBounds, "negative"),
        ((4 * MiB - 10, 0, 11), OutOfBounds, "local"),
        ((0, 4 * MiB - 10, 11), OutOfBounds, "remote"),
        ((0, 2**63 + 5, 1), OutOfBounds, "2\\*\\*63"),
    ],
)
def test_bad_requests_refuse_the_whole_batch(pair, args, exc, match):
    a, b, seg, local, rs = pair
    before = seg.array().copy()
    local.array()[:] = 0xAB
    bt = a.batch()
    bt.add(Op.WRITE, local, 0, rs, 0, 4096)  # a valid request in the same batch
    bt.add(Op.WRITE, local, *args[:1], rs, *args[1:])
    with pytest.raises(exc, match=match):
        bt.submit()
    assert bt.state is BatchState.OPEN
    bt.free()
    assert (seg.array() == before).all()  # not a byte moved, not even the valid request
    with pytest.raises(exc):
        a.write(local, args[0], rs, args[1], args[2])
    big = np.zeros(300, np.int64)
    big[-1] = args[2]
    with pytest.raises(exc):  # the vectorised check finds it too
        a.transfer(
            Op.WRITE,
            local,
            np.where(big == args[2], args[0], 0),
            rs,
            np.where(big == args[2], args[1], 0),
            np.where(big == args[2], args[2], 1),
        )
    assert (seg.array() == before).all()


def test_bad_arguments_get_specific_errors(pair, make_engine):
    a, b, seg, local, rs = pair
    foreign = make_engine().register(np.zeros(16, np.uint8))
    with pytest.raises(NotRegistered):
        a.read(foreign, 0, rs, 0, 8)
    with pytest.raises(NotRegistered):
        a.read(np.zeros(8, np.uint8), 0, rs, 0, 8)
    with pytest.raises(InvalidArgument):
        a.read(local, 0, "pool", 0, 8)
    with pytest.raises(InvalidArgument):
        a.transfer("copy", local, [0], rs, [0], [8])
    with pytest.raises(InvalidArgument):
        a.transfer(Op.READ, local, [0.5], rs, [0], [8])
    with pytest.raises(InvalidLength):
        a.transfer(Op.READ, local, [0, 8], rs, [0], [8, 8])
    with pytest.raises(SegmentNotFound, match="nope"):
        a.open_segment(b.address, "nope")
    gone = a.register(np.zeros(16, np.uint8))
    a.unregister(gone)
    with pytest.raises(NotRegistered):
        a.read(gone, 0, rs, 0, 8)


def test_batch_state_misuse(pair):
    a, b, seg, local, rs = pair
    bt = a.batch()
    with pytest.raises(BatchStateError):
        bt.wait()
    bt.add(Op.READ, local, 0, rs, 0, 8)
    bt.submit()
    with pytest.raises(BatchStateError):
        bt.submit()
    with pytest.raises(BatchStateError):
        bt.add(Op.READ, local, 0, rs, 0, 8)
    bt.wait()
    bt.free()
    with pytest.raises(BatchStateError):
        bt.wait()
    empty = a.batch().submit()
    assert empty.wait().state is BatchState.DONE and empty.wait().requests == 0


def test_many_threads_many_batches_in_flight(pair):
    a, b, seg, local, rs = pair
    page, threads, rounds = 8192, 8, 25
    per = (4 * MiB // page) // threads  # each thread owns a disjoint slice of pages
    src = np.random.default_rng(3).integers(0, 256, 4 * MiB, dtype=np.uint8)
    local.array()[:] = src
    errors = []

    def worker(t):
        try:
            rng = np.random.default_rng(t)
            mine = np.arange(t * per, (t + 1) * per)
            for r in range(rounds):
                pick = rng.permutation(mine)[: per // 2]
                bt = a.batch()
                bt.add_many(Op.WRITE, local, pick * page, rs, pick * page, page)
                bt.submit()
                if r % 2:
                    bt.wait()
                    bt.free()
                else:
                    with a.batch() as b2:  # a second batch in flight at the same time
                        b2.add_many(Op.READ, local, pick * page, rs, pick * page, page)
                        b2.submit()
                        bt.wait()
                        b2.wait()
                    bt.free()
        except BaseException as exc:  # reported below
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors
    a.write(local, 0, rs, 0, 4 * MiB)  # every page once more, then compare
    assert (seg.array() == src).all()


def test_async_submit_then_free_cancels_cleanly(make_engine):
    a, b = make_engine(split_bytes=4 * MiB), make_engine()
    _seg = b.alloc_shared(64 * MiB, name="big")  # keep the segment alive
    local = a.register(np.ones(64 * MiB, np.uint8))
    rs = a.open_segment(b.address, "big")
    offs = np.zeros(256, np.int64)  # 256 x the same 64 MiB: 16 GiB of copying if not cancelled
    bt = a.batch()
    bt.add_many(Op.WRITE, local, offs, rs, offs, 64 * MiB)
    t0 = time.monotonic()
    bt.submit()
    time.sleep(0.05)
    bt.free()
    assert time.monotonic() - t0 < 30
    st = bt.status()
    assert (st == RequestStatus.CANCELLED).any()
    assert set(np.unique(st).tolist()) <= {RequestStatus.DONE, RequestStatus.CANCELLED}
    assert a.read(local, 0, rs, 0, 4096).state is BatchState.DONE  # the engine keeps working


def test_tensor_api_in_process(make_engine):
    a, b = make_engine(), make_engine()
    src = torch.arange(24, dtype=torch.float16).reshape(2, 3, 4)
    b.expose_tensor("w", src)
    out = torch.zeros(2, 3, 4, dtype=torch.float16)
    res = a.read_tensor(b.address, "w", out)
    assert torch.equal(out, src) and res.transports == [TransportKind.LOCAL]
    a.write_tensor(b.address, "w", torch.full((2, 3, 4), 3.0, dtype=torch.float16))
    assert (src == 3).all()
    with pytest.raises(TensorMismatch):
        a.read_tensor(b.address, "w", torch.zeros(24, dtype=torch.float16))
    with pytest.raises(TensorMismatch):
        a.read_tensor(b.address, "w", torch.zeros(2, 3, 4, dtype=torch.bfloat16))
    with pytest.raises(SegmentNotFound):
        a.read_tensor(b.address, "nope", out)
    arr = np.zeros((2, 3, 4), np.float16)  # numpy arrays work as well
    b.expose_tensor("np", np.arange(24, dtype=np.float16).reshape(2, 3, 4))
    a.read_tensor(b.address, "np", arr)
    assert arr.ravel().tolist() == list(range(24))
    assert len(a.regions()) == 0  # temporary registrations are gone again


def test_publish_unpublish_replace(pair):
    a, b, seg, local, rs = pair
    with pytest.raises(SegmentExists):
        b.publish(seg, "pool")
    b.unpublish("pool")
    deadline = time.monotonic() + 10
    while rs.stale_reason is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the removal notice travels over the watch connection
    assert rs.stale_reason and "removed" in rs.stale_reason
    with pytest.raises(SegmentNotFound):
        a.read(local, 0, rs, 0, 8)
    desc = b.publish(seg, "pool")
    rs2 = a.open_segment(b.address, "pool")
    assert rs2 is not rs and rs2.desc.seg_id == desc.seg_id
    a.read(local, 0, rs2, 0, 8)
    assert [d.name for d in a.list_segments(b.address)] == ["pool"]


def test_locate_raw_peer_addresses(make_engine):
    a, b = make_engine(), make_engine()
    x, y = np.zeros(8192, np.uint8), np.zeros(4096, np.uint8)
    _rx, _ry = b.register(x, name="x"), b.register(y, name="y")  # keep registrations alive
    seg, off = a.locate(b.address, y.ctypes.data + 100, 50)
    assert seg.name == "y" and off == 100
    segs, idx, offs = a.locate_many(
        b.address, [x.ctypes.data, y.ctypes.data + 4095, x.ctypes.data + 8000], [10, 1, 192]
    )
    assert [segs[i].name for i in idx] == ["x", "y", "x"] and offs.tolist() == [0, 4095, 8000]
    z = np.zeros(100, np.uint8)
    b.register(z, name="z")  # published after our first lookup: found on refresh
    assert a.locate(b.address, z.ctypes.data + 99)[0].name == "z"
    with pytest.raises(SegmentNotFound):
        a.locate(b.address, x.ctypes.data + 8000, 500)


def test_locate_table_forgets_a_removed_segment(make_engine):
    """locate_many keeps a sorted table of a peer's segments between calls: a segment its
    owner removed must drop out of it (here: be refused), never be answered from the table."""
    a, b = make_engine(), make_engine()
    x, y = np.zeros(8192, np.uint8), np.zeros(4096, np.uint8)
    _rx, ry = b.register(x, name="x"), b.register(y, name="y")
    for _ in range(3):  # the table is built, then used
        segs, idx, _ = a.locate_many(b.address, [x.ctypes.data, y.ctypes.data], [1, 1])
        assert [segs[i].name for i in idx] == ["x", "y"]
    held = segs[int(idx[1])]
    b.unregister(ry)
    deadline = time.monotonic() + 10
    while held.stale_reason is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the removal notice travels over the watch connection
    assert held.stale_reason is not None
    with pytest.raises(SegmentNotFound):
        a.locate_many(b.address, [y.ctypes.data], [1])
    assert a.locate(b.address, x.ctypes.data)[0].name == "x"


def test_closed_engine_refuses_and_stops_its_threads():
    before = {t.ident for t in threading.enumerate()}
    eng = TransferEngine()
    peer = TransferEngine()
    peer.alloc_shared(MiB, name="s")
    r = eng.register(np.zeros(MiB, np.uint8))
    eng.read(r, 0, eng.open_segment(peer.address, "s"), 0, 10)
    eng.close()
    peer.close()
    with pytest.raises(EngineClosed):
        eng.register(np.zeros(4, np.uint8))
    with pytest.raises(EngineClosed):
        eng.batch()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [
            t
            for t in threading.enumerate()
            if t.ident not in before and t.name.startswith("kvmesh")
        ]
        if not left:
            break
        time.sleep(0.05)
    assert not left, left


def test_shared_accessor_is_one_engine_per_process():
    shutdown_engine()
    try:
        got = []
        ts = [threading.Thread(target=lambda: got.append(get_engine())) for _ in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert len({id(e) for e in got}) == 1
        eng = got[0]
        assert init_engine() is eng and get_engine() is eng
        assert init_engine(node_id=eng.node_id) is eng
        with pytest.raises(InvalidArgument):
            init_engine(node_id="somebody-else")
        with pytest.raises(InvalidArgument):
            init_engine(listen="127.0.0.1:1")
        shutdown_engine()
        assert eng.closed
        fresh = init_engine(node_id="fresh")
        assert fresh is not eng and fresh.node_id == "fresh" and get_engine() is fresh
    finally:
        shutdown_engine()


def test_engine_talks_to_itself(make_engine):
    eng = make_engine()
    seg = eng.alloc_shared(MiB, name="own")
    buf = eng.register(np.arange(MiB, dtype=np.uint64).astype(np.uint8))
    rs = eng.open_segment(eng.address, "own")
    assert eng.write(buf, 0, rs, 0, MiB).transports == [TransportKind.LOCAL]
    assert (seg.array() == buf.array()).all()
    assert eng.ping(eng.address) > 0
    assert [d.name for d in eng.list_segments(eng.address)] == ["own"]
    assert eng.info()["segments"] == ["own"]


def test_owner_rechecks_requests_it_receives(make_engine):
    """The owner never trusts the requester: bad raw requests are refused, the stream survives."""
    import msgspec

    from kvmesh.transfer import OutOfBounds as OOB

    owner, client = make_engine(), make_engine()
    seg = owner.alloc_shared(MiB, name="s")
    seg.array()[:] = 1
    desc = client.open_segment(owner.address, "s").desc
    peer = client.peer(owner.address)
    payload = np.full(8192, 9, np.uint8)
    u = lambda *v: np.array(v, dtype=np.uint64)  # noqa: E731
    views = lambda: [memoryview(payload)[:4096], memoryview(payload)[4096:]]  # noqa: E731
    with pytest.raises(OOB):
        tcp.write_views(peer, desc, u(0, MiB - 100), u(4096, 4096), views(), 8192, 5.0)
    stale = msgspec.structs.replace(desc, seg_id=desc.seg_id + 1)
    with pytest.raises(SegmentNotFound, match="replaced"):
        tcp.write_views(peer, stale, u(0, 4096), u(4096, 4096), views(), 8192, 5.0)
    with pytest.raises(SegmentNotFound):
        tcp.read_views(
            peer,
            msgspec.structs.replace(desc, name="other"),
            u(0),
            u(16),
            [memoryview(bytearray(16))],
            16,
            5.0,
        )
    assert (seg.array() == 1).all()  # nothing landed
    # pooled connections still fine
    tcp.write_views(peer, desc, u(0, 4096), u(4096, 4096), views(), 8192, 5.0)
    assert (seg.array()[:8192] == 9).all() and (seg.array()[8192:] == 1).all()


def test_transfer_by_raw_addresses(make_engine):
    owner, client = make_engine(), make_engine()
    x = np.zeros(64 * 1024, np.uint8)
    y = np.zeros(32 * 1024, np.uint8)
    owner.register(x, name="x")
    owner.register(y, name="y")
    a = np.random.default_rng(1).integers(0, 256, 16 * 1024, dtype=np.uint8)
    b = np.random.default_rng(2).integers(0, 256, 16 * 1024, dtype=np.uint8)
    client.register(a)
    client.register(b)
    pa, pb, px, py = a.ctypes.data, b.ctypes.data, x.ctypes.data, y.ctypes.data
    # Four requests touching two local regions and two remote segments, mixed.
    local = [pa, pb + 4096, pa + 8192, pb]
    remote = [py + 100, px, px + 50_000, py + 20_000]
    lens = [4096, 8192, 1000, 4096]
    res = client.transfer_by_address(Op.WRITE, owner.address, local, remote, lens)
    assert res.requests == 4 and res.transports == [TransportKind.LOCAL]
    assert (y[100:4196] == a[:4096]).all() and (x[:8192] == b[4096:12288]).all()
    assert (x[50_000:51_000] == a[8192:9192]).all() and (y[20_000:24_096] == b[:4096]).all()
    out = np.zeros(4096, np.uint8)
    client.register(out)
    client.transfer_by_address("read", owner.address, [out.ctypes.data], [py + 100], [4096])
    assert (out == a[:4096]).all()
    with pytest.raises(NotRegistered):
        client.transfer_by_address(Op.WRITE, owner.address, [pa + 16 * 1024 - 10], [px], [20])
    with pytest.raises(SegmentNotFound):
        client.transfer_by_address(Op.WRITE, owner.address, [pa], [px + 64 * 1024 - 10], [20])
    with pytest.raises(InvalidLength):
        client.transfer_by_address(Op.WRITE, owner.address, [pa], [px], [0])


def test_sync_batch_of_small_jobs_runs_in_the_caller(make_engine, monkeypatch):
    # A PD request bigger than split_bytes but made of small per-layer jobs: handing each job
    # to the workers ran slower than copying in the caller (docs/sglang.md, "Shared-memory
    # pools: measured"); jobs above inline_bytes still fan out.
    owner, client = make_engine(), make_engine(split_bytes=2 * MiB, inline_bytes=MiB)
    handed: list[object] = []
    submit = client._batch_ctx.submit
    monkeypatch.setattr(client._batch_ctx, "submit", lambda t: (handed.append(t), submit(t)))
    rng = np.random.default_rng(4)
    cases = []
    for size, pairs, fan_out in ((MiB // 2, 8, False), (2 * MiB, 4, True)):
        dst = [np.zeros(size, np.uint8) for _ in range(pairs)]
        src = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(pairs)]
        for i, x in enumerate(dst):
            owner.register(x, name=f"d{size}-{i}")
        for x in src:
            client.register(x)
        cases.append((size, pairs, fan_out, dst, src))
    for size, pairs, fan_out, dst, src in cases:
        handed.clear()
        res = client.transfer_by_address(
            Op.WRITE,
            owner.address,
            [x.ctypes.data for x in src],
            [x.ctypes.data for x in dst],
            [size] * pairs,
        )
        assert res.nbytes == size * pairs > client.config.split_bytes
        assert all((d == s).all() for d, s in zip(dst, src))
        assert bool(handed) is fan_out, (size, len(handed))


def test_same_process_gpu_memory_goes_through_cuda(make_engine, monkeypatch):
    """Routing only: CUDA is simulated with a host copy (real GPUs: scripts/gpu_check.sh)."""
    from kvmesh.transfer import cuda, fastcopy

    calls = []

    def fake_copy_runs(dst, dst_offsets, src, src_offsets, lengths, device, check=None):
        calls.append(device)
        fastcopy.copy_ranges(dst, dst_offsets, src, src_offsets, lengths, check)

    monkeypatch.setattr(cuda, "available", lambda: True)
    monkeypatch.setattr(cuda, "copy_runs", fake_copy_runs)
    eng = make_engine(transports_allow=["local"])
    fake_gpu = np.zeros(MiB, np.uint8)  # host memory registered as if it were device 3
    eng.register_raw(fake_gpu.ctypes.data, MiB, "vram", 3, owner=fake_gpu, name="gpu")
    host = eng.register(np.random.default_rng(0).integers(0, 256, MiB, dtype=np.uint8))
    rs = eng.open_segment(eng.address, "gpu")
    assert eng.write(host, 0, rs, 0, MiB).transports == [TransportKind.LOCAL]
    assert (fake_gpu == host.array()).all() and calls == [3]
    monkeypatch.setattr(cuda, "available", lambda: False)
    other = make_engine(transports_allow=["local"])
    h2 = other.register(np.zeros(16, np.uint8))
    from kvmesh.transfer import TransportUnavailable

    with pytest.raises(TransportUnavailable):  # no CUDA: GPU memory is out of reach
        other.read(h2, 0, other.open_segment(eng.address, "gpu"), 0, 16)


def _by_address_pairs(owner, client, pairs: int, size: int, seed: int):
    """``pairs`` source regions in ``client`` and destination segments in ``owner``."""
    rng = np.random.default_rng(seed)
    src = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(pairs)]
    dst = [np.zeros(size, np.uint8) for _ in range(pairs)]
    srcs = [client.register(x) for x in src]
    dsts = [owner.register(x, name=f"d{seed}-{i}") for i, x in enumerate(dst)]
    # Two scattered blocks per pair, the second before the first on the destination side.
    half = size // 4
    local = [p for x in src for p in (x.ctypes.data, x.ctypes.data + 2 * half)]
    remote = [p for x in dst for p in (x.ctypes.data + 3 * half, x.ctypes.data + half)]
    return src, dst, srcs, dsts, local, remote, [half] * len(local)


def _idle(*objs) -> bool:
    return all(o._users == 0 for o in objs)


def test_by_address_groups_run_in_the_caller_without_a_batch(make_engine, monkeypatch):
    # issue 9: a PD call of many region pairs ran through Batch (status array, one Task and
    # one lock round per group) and cost ~1 ms for 1,024 blocks in 64 pairs. Below the inline
    # rule it now runs as the lean path does, one job per pair, with every guarantee kept.
    import kvmesh.transfer.engine as engine_mod

    owner, client = make_engine(), make_engine()
    src, dst, srcs, dsts, local, remote, lens = _by_address_pairs(owner, client, 8, 64 << 10, 5)

    def no_batch(*a, **k):
        raise AssertionError("a small multi-region sync call must not build a Batch")

    monkeypatch.setattr(engine_mod, "Batch", no_batch)
    before = client.info()["batches"]
    res = client.transfer_by_address(Op.WRITE, owner.address, local, remote, lens)
    q = (64 << 10) // 4
    for s, d in zip(src, dst):
        assert (d[3 * q :] == s[:q]).all() and (d[q : 2 * q] == s[2 * q : 3 * q]).all()
        assert not d[:q].any() and not d[2 * q : 3 * q].any()
    assert res.state is BatchState.DONE and res.failed == 0
    assert res.requests == 16 and res.nbytes == sum(lens)
    assert res.transports == [TransportKind.LOCAL]
    assert client.info()["batches"] == before + 1
    handles = [h for rs in client._remote.values() for h in rs._routes.values()]
    assert len(handles) == 8 and _idle(*srcs, *handles)
    client.unregister(srcs[3], timeout=1.0)  # nothing pins it: returns at once


def _peer_of(client, owner):
    return client.peer(owner.address)


def test_by_address_writes_to_one_tcp_peer_go_back_to_back_on_one_connection(
    make_engine, monkeypatch
):
    # issue 9: a PD request over TCP is one small job per layer buffer; each went to a worker
    # thread and waited a round trip for its Ack. Now the calling thread sends them all on one
    # connection and reads the Acks behind (more jobs than the pipeline depth here).
    import kvmesh.transfer.engine as engine_mod
    from kvmesh.transfer.transports import tcp

    owner, client = make_engine(), make_engine(transport="tcp")
    pairs = tcp.PIPELINE_DEPTH + 8
    src, dst, srcs, dsts, local, remote, lens = _by_address_pairs(owner, client, pairs, 64 << 10, 7)

    def no_batch(*a, **k):
        raise AssertionError("small WRITEs to one TCP peer must not build a Batch")

    def no_single(self, job):
        raise AssertionError("small WRITEs to one TCP peer must not run one request at a time")

    monkeypatch.setattr(engine_mod, "Batch", no_batch)
    monkeypatch.setattr(tcp.TcpTransport, "execute", no_single)
    for _ in range(2):  # the second call reuses the pooled connection
        res = client.transfer_by_address(Op.WRITE, owner.address, local, remote, lens)
        q = (64 << 10) // 4
        for s, d in zip(src, dst):
            assert (d[3 * q :] == s[:q]).all() and (d[q : 2 * q] == s[2 * q : 3 * q]).all()
        assert res.state is BatchState.DONE and res.nbytes == sum(lens)
        assert res.transports == [TransportKind.TCP]
        # Every Ack was read: the pooled connection answers the next request, not a stale Ack.
        client.ping(owner.address)
        assert len(_peer_of(client, owner)._idle) == 1, "one connection carried the call"
        for d in dst:
            d[:] = 0
    handles = [h for rs in client._remote.values() for h in rs._routes.values()]
    assert _idle(*srcs, *handles)


def test_a_pipelined_write_refused_by_the_owner_fails_the_call_and_spoils_nothing(
    make_engine, monkeypatch
):
    from kvmesh.transfer.transports import tcp

    owner, client = make_engine(), make_engine(transport="tcp")
    src, dst, srcs, dsts, local, remote, lens = _by_address_pairs(owner, client, 6, 64 << 10, 8)
    client.transfer_by_address(Op.WRITE, owner.address, local, remote, lens)  # routes, a conn
    real = tcp.TcpServer._resolve

    def refuse_d8_2(self, req, offsets, lengths):
        if req.segment == "d8-2":
            raise SegmentNotFound("injected: segment 'd8-2' refused by its owner")
        return real(self, req, offsets, lengths)

    monkeypatch.setattr(tcp.TcpServer, "_resolve", refuse_d8_2)
    for d in dst:
        d[:] = 0
    with pytest.raises(SegmentNotFound, match="injected"):
        client.transfer_by_address(Op.WRITE, owner.address, local, remote, lens)
    assert not dst[2].any(), "the refused request's payload was drained, not landed"
    # The connection with unread Acks behind the error is closed, not pooled; what follows on
    # a fresh one works, and nothing is left held.
    assert not _peer_of(client, owner)._idle
    monkeypatch.setattr(tcp.TcpServer, "_resolve", real)
    res = client.transfer_by_address(Op.WRITE, owner.address, local, remote, lens)
    assert res.nbytes == sum(lens)
    q = (64 << 10) // 4
    for s, d in zip(src, dst):
        assert (d[3 * q :] == s[:q]).all() and (d[q : 2 * q] == s[2 * q : 3 * q]).all()
    client.ping(owner.address)
    handles = [h for rs in client._remote.values() for h in rs._routes.values()]
    assert _idle(*srcs, *handles)


def test_a_pipelined_write_the_owner_cannot_skip_reports_the_owners_reason(make_engine):
    # The owner refuses a request above its own size limit and closes the connection (it cannot
    # skip the payload); the client, still sending the requests behind it, gets the owner's
    # reason, not a broken pipe.
    from kvmesh.transfer import RequestTooLarge

    owner = make_engine(max_request_bytes=96 << 10)
    client = make_engine(transport="tcp")
    src, dst, srcs, dsts, local, remote, lens = _by_address_pairs(owner, client, 8, 4 << 20, 9)
    t0 = time.monotonic()
    with pytest.raises(RequestTooLarge, match="limit"):
        client.transfer_by_address(Op.WRITE, owner.address, local, remote, lens)
    assert time.monotonic() - t0 < 10
    assert not _peer_of(client, owner)._idle
    handles = [h for rs in client._remote.values() for h in rs._routes.values()]
    assert _idle(*srcs, *handles)


def test_by_address_inline_refuses_before_a_byte_and_releases_on_failure(make_engine, monkeypatch):
    owner, client = make_engine(), make_engine()
    src, dst, srcs, dsts, local, remote, lens = _by_address_pairs(owner, client, 4, 64 << 10, 6)
    client.transfer_by_address(Op.WRITE, owner.address, local, remote, lens)  # opens the routes
    for d in dst:
        d[:] = 0
    handles = {rs.name: h for rs in client._remote.values() for h in rs._routes.values()}
    # The last pair's route closes under the call: refused with nothing copied anywhere.
    handles["d6-3"].close()
    with pytest.raises(SegmentNotFound):
        client.transfer_by_address(Op.WRITE, owner.address, local, remote, lens)
    assert not any(d.any() for d in dst)
    assert _idle(*srcs, *handles.values())
    # A transport failing on the second job: the call fails as a whole, the rest never runs,
    # and every region and route it held is let go.
    client._remote.clear()  # forget the closed route: new handles
    client._locate_cache.clear()  # (and locate_many's table of the old segments)
    local_t = client.transport(TransportKind.LOCAL)
    real, calls = local_t.execute, []

    def flaky(job):
        calls.append(job.remote.name)
        if len(calls) == 2:
            raise RuntimeError("injected copy failure")
        real(job)

    monkeypatch.setattr(local_t, "execute", flaky)
    with pytest.raises(TransferError, match="injected copy failure"):
        client.transfer_by_address(Op.WRITE, owner.address, local, remote, lens)
    assert len(calls) == 2
    handles = [h for rs in client._remote.values() for h in rs._routes.values()]
    assert _idle(*srcs, *handles)
    for r in srcs:
        client.unregister(r, timeout=1.0)


@pytest.mark.parametrize("via", ["by_address", "grouped"])
def test_by_address_merges_blocks_adjacent_on_both_sides_once(make_engine, monkeypatch, via):
    # SGLang sends a request's pages block by block; blocks adjacent in both the local and the
    # peer memory (of one region pair) go to the transport as one run, merged once per call.
    # transfer_by_address and transfer_grouped share the one grouping (and its merge).
    owner, client = make_engine(), make_engine()
    rng = np.random.default_rng(8)
    src = [rng.integers(0, 256, 64 << 10, dtype=np.uint8) for _ in range(2)]
    dst = [np.zeros(64 << 10, np.uint8) for _ in range(2)]
    regions = [client.register(x) for x in src]
    for i, x in enumerate(dst):
        owner.register(x, name=f"m{i}")
    k = 4096
    local, remote = [], []
    for s, d in zip(src, dst):
        s0, d0 = s.ctypes.data, d.ctypes.data
        # blocks 0,1,2 adjacent on both sides; 3 adjacent locally only; 5 then 4 (reversed)
        local += [s0, s0 + k, s0 + 2 * k, s0 + 3 * k, s0 + 5 * k, s0 + 4 * k]
        remote += [d0, d0 + k, d0 + 2 * k, d0 + 8 * k, d0 + 10 * k, d0 + 9 * k]
    local_t = client.transport(TransportKind.LOCAL)
    real, jobs = local_t.execute, []

    def spy(job):
        jobs.append((job.lengths.tolist(), job.coalesced()[2].tolist()))
        real(job)

    monkeypatch.setattr(local_t, "execute", spy)
    if via == "by_address":
        res = client.transfer_by_address(Op.WRITE, owner.address, local, remote, [k] * len(local))
    else:
        segs = [client.open_segment(owner.address, f"m{i}") for i in range(2)]
        pair = np.repeat([1, 0], 6)  # the second pair's requests first: grouped back
        order = np.r_[6:12, 0:6]
        lo = np.array(local, np.int64)[order] - np.array([r.ptr for r in regions])[pair]
        ro = np.array(remote, np.int64)[order] - np.array([d.ctypes.data for d in dst])[pair]
        got = client.transfer_grouped(Op.WRITE, regions, pair, lo, segs, pair, ro, np.full(12, k))
        assert got.ok.all() and not got.one_by_one and len(got.results) == 1
        res = got.results[0]
    assert res.requests == 12 and res.nbytes == 12 * k
    assert sorted(jobs) == [([3 * k, k, k, k], [3 * k, k, k, k])] * 2
    for s, d in zip(src, dst):
        assert (d[: 3 * k] == s[: 3 * k]).all() and (d[8 * k : 9 * k] == s[3 * k : 4 * k]).all()
        assert (d[10 * k : 11 * k] == s[5 * k : 6 * k]).all()
        assert (d[9 * k : 10 * k] == s[4 * k : 5 * k]).all()
        assert not d[3 * k : 8 * k].any() and not d[11 * k :].any()


def test_transfer_grouped_moves_columns_over_pairs_and_fails_a_refused_group_alone(make_engine):
    """``transfer_grouped``: requests as columns over two local regions and two segments,
    in mixed order, land where each names (the grouping per pair keeps every request's own
    offsets); a batch refused because one segment is gone runs group by group, and only
    that segment's requests fail (``ok`` in the caller's order)."""
    owner, client = make_engine(), make_engine()
    x = np.zeros(64 * 1024, np.uint8)
    y = np.zeros(64 * 1024, np.uint8)
    owner.register(x, name="x")
    owner.register(y, name="y")
    a = np.random.default_rng(3).integers(0, 256, 32 * 1024, dtype=np.uint8)
    b = np.random.default_rng(4).integers(0, 256, 32 * 1024, dtype=np.uint8)
    ra, rb = client.register(a), client.register(b)
    sx, sy = client.open_segment(owner.address, "x"), client.open_segment(owner.address, "y")
    n = 16
    reg = np.array([i % 2 for i in range(n)], np.int64)  # a, b, a, b ...
    seg = np.array([(i // 3) % 2 for i in range(n)], np.int64)  # x x x y y y x ...
    lo = np.arange(n, dtype=np.int64) * 2048
    ro = (np.arange(n, dtype=np.int64)[::-1]) * 4096  # remote order reversed
    ln = np.full(n, 1000, np.int64)
    got = client.transfer_grouped(Op.WRITE, [ra, rb], reg, lo, [sx, sy], seg, ro, ln)
    assert got.ok.all() and not got.one_by_one and sum(r.nbytes for r in got.results) == n * 1000
    for i in range(n):
        src = (a, b)[reg[i]][lo[i] : lo[i] + 1000]
        dst = (x, y)[seg[i]][ro[i] : ro[i] + 1000]
        assert (src == dst).all(), i
    owner.unregister(owner.find_region(y.ctypes.data, 1)[0])  # segment y goes away
    x[:] = 0
    got = client.transfer_grouped(Op.WRITE, [ra, rb], reg, lo, [sx, sy], seg, ro, ln)
    assert (got.ok == (seg == 0)).all(), got.ok
    for i in np.flatnonzero(seg == 0).tolist():
        assert (x[ro[i] : ro[i] + 1000] == (a, b)[reg[i]][lo[i] : lo[i] + 1000]).all()
