"""Every MooncakeDistributedStore method group on this process's embedded store, with
Mooncake's results: lifecycle (many stores per process, close and set up again, get_hostname
as preferred_segment), put/upsert forms (an existing key answers 0), get forms (a miss is
b"" / None / a code as Mooncake returns it), sessions, ranges, query/remove, tensors."""

from __future__ import annotations

import ctypes
import tracemalloc

import pytest

from kvmesh.store.compat import (
    MooncakeDistributedStore,
    ParallelAxis,
    ReadTarget,
    ReplicateConfig,
    SoftPinAction,
    TensorParallelism,
    bind_to_numa_node,
)

torch = pytest.importorskip("torch")


def _store(seg="16MB", buf="16MB", host="localhost"):
    s = MooncakeDistributedStore()
    cfg = {"local_hostname": host, "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}
    cfg.update(global_segment_size=seg, local_buffer_size=buf, master_server_addr="embedded")
    assert s.setup(cfg) == 0
    return s


@pytest.fixture
def store():
    s = _store()
    yield s
    s.remove_all(True)
    s.close()


def _buf(n):
    b = (ctypes.c_ubyte * n)()
    return b, ctypes.addressof(b)


def test_many_stores_close_and_setup_again():
    stores = [_store() for _ in range(3)]
    names = {s.get_hostname() for s in stores}
    assert len(names) == 3 and all(n.startswith("localhost:") for n in names)
    assert all(12300 <= int(n.split(":")[1]) <= 14300 for n in names)
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    assert stores[0].put("two", b"copies", cfg) == 0
    assert len(stores[0].get_replica_desc("two")) == 2
    assert stores[0].close() == 0
    assert stores[1].get("two") == b"copies"  # the other copy stays
    for _ in range(2):  # set up again (a new segment name), twice
        assert stores[0].setup("localhost", "", 1 << 20, 1 << 20, "tcp", "", "embedded") == 0
        assert stores[0].health_check() == 0 and stores[0].close() == 0
    fixed = _store(host="localhost:12999")
    assert fixed.get_hostname() == "localhost:12999"
    fixed.close()
    again = _store(host="localhost:12999")  # the name is quarantined: still set up
    assert again.get_hostname() == "localhost:12999"
    pref = ReplicateConfig()
    pref.preferred_segment = again.get_hostname()
    assert stores[1].put("on-again", b"x" * 100, pref) == 0
    d = stores[1].batch_get_replica_desc(["on-again"])["on-again"]
    assert d and d[0].segment_name.startswith("localhost:12999")
    for s in (again, *stores):
        s.remove_all(True)
        s.close()
    bind_to_numa_node(0)


def test_put_forms(store):
    assert store.put("k", b"v1") == 0
    assert store.put("k", b"other") == 0  # exists: 0, the object stays
    assert store.get("k") == b"v1"
    assert store.put_batch(["b1", "b2"], [b"1", b"22"]) == 0
    assert store.upsert_batch(["b1", "b3"], [b"111", b"3"]) == 0
    assert store.put_parts("parts", b"ab", memoryview(b"cd"), bytearray(b"ef")) == 0
    assert store.get("parts") == b"abcdef"
    assert store.upsert_parts("parts", b"x", b"y") in (0, -706)
    raw, ptr = _buf(64)
    ctypes.memmove(ptr, b"A" * 16 + b"M" * 8, 24)
    assert store.register_buffer(ptr, 64) == 0
    assert store.put_from("pf", ptr, 16) == 0 and store.put_from("pf", ptr, 16) == 0
    assert store.upsert_from("pf", ptr + 16, 8) in (0, -706)
    assert store.batch_put_from(["q1", "q2"], [ptr, ptr + 16], [16, 8]) == [0, 0]
    assert store.batch_upsert_from(["q1"], [ptr + 16], [8]) == [0]
    assert store.put_from_with_metadata("meta", ptr, ptr + 16, 16, 8) == 0
    assert store.get("meta") == b"M" * 8 + b"A" * 16  # metadata first, as Mooncake
    assert store.batch_put_from_multi_buffers(["mb"], [[ptr, ptr + 16]], [[4, 4]]) == [0]
    assert store.get("mb") == b"AAAAMMMM"
    assert store.batch_put_from(["x"], [ptr, ptr], [1]) == [-600]  # mismatched lists
    assert store.batch_put_from([], [], []) == []
    with pytest.raises(TypeError):
        store.batch_put_from("abc", [ptr], [1])
    with pytest.raises(TypeError):
        store.put(key_arg_name_error="k", value=b"v")


def test_config_refusals(store):
    ttl = ReplicateConfig()
    ttl.soft_pin_ttl_ms = 1000
    assert store.put("sp", b"v", ttl) == -600  # a TTL under PRESERVE
    ttl.soft_pin_action = SoftPinAction.DISABLE
    assert store.upsert("sp", b"v", ttl) == -600
    ttl.soft_pin_action = SoftPinAction.ENABLE
    assert store.put("sp", b"v", ttl) == 0
    g = ReplicateConfig()
    g.group_ids = ["g1"]
    assert store.put_batch(["g1", "g2"], [b"1", b"2"], g) == -600  # one id per key
    g.group_ids = ["g1", "g2"]
    assert store.put_batch(["g1", "g2"], [b"1", b"2"], g) == 0
    nof = ReplicateConfig()
    nof.nof_replica_num = 1
    assert store.put("nof", b"v", nof) == -1012
    with pytest.raises(TypeError):
        store.put("k", b"v", "not a config")


def test_local_buffer_limits_the_byte_path():
    s = _store(buf=0)
    try:
        assert s.put("zero-buffer", b"value") != 0
        assert s.is_exist("zero-buffer") == 0
    finally:
        s.close()


def test_get_forms(store):
    assert store.put("g", b"hello") == 0
    assert store.get("missing") == b""
    assert store.get_batch(["g", "missing"]) == [b"hello", b""]
    h = store.get_buffer("g")
    assert bytes(h) == b"hello" and h.size() == 5 and ctypes.string_at(h.ptr(), 5) == b"hello"
    assert store.get_buffer("missing") is None
    assert [None if b is None else bytes(b) for b in store.batch_get_buffer(["g", "no"])] == [
        b"hello",
        None,
    ]
    raw, ptr = _buf(32)
    assert store.register_buffer(ptr, 32) == 0
    assert store.get_into("g", ptr, 32) == 5 and bytes(raw[:5]) == b"hello"
    assert store.get_into("g", ptr, 2) == -10 and store.get_into("missing", ptr, 8) == -704
    assert store.batch_get_into(["g", "missing"], [ptr, ptr + 8], [8, 8]) == [5, -704]
    assert store.batch_get_into_multi_buffers(["g"], [[ptr + 16, ptr + 20]], [[4, 4]]) == [5]
    assert bytes(raw[16:21]) == b"hello"
    got = store.get_into_ranges([ptr], [["g", "missing"]], [[[0, 8], [4]]], [[[1, 3], [0]]],
                                [[[2, 2], [1]]])  # fmt: skip
    assert got[0][0] == [2, 2] and got[0][1][0] < 0 and bytes(raw[0:2]) == b"el"
    assert store.get_into_ranges([ptr], [["g"]], [[[31]]], [[[0]]], [[[4]]])[0][0][0] < 0
    assert store.get_into_ranges([ptr], [["g"]], [[[0]]], [[[0, 1]]], [[[1]]])[0][0][0] < 0
    with pytest.raises(TypeError):
        store.get_batch("g")


def test_get_buffer_copies_once(store):
    """get_buffer / batch_get_buffer copy the object once, from the staging buffer into the
    handle (no bytes object on the way): the call's peak of traced allocations holds the
    handles and little else. Memory accounting, not timing."""
    n = 4 << 20
    value = bytes(range(256)) * (n // 256)
    assert store.put("big", value) == 0 and store.put("big2", value[::-1]) == 0
    # Warm: the staging buffers of both calls made (and kept for reuse).
    assert bytes(store.get_buffer("big")) == value
    assert len(store.batch_get_buffer(["big", "big2"])) == 2
    tracemalloc.start()
    try:
        for call, handles in (
            (lambda: [store.get_buffer("big")], 1),
            (lambda: store.batch_get_buffer(["big", "big2", "missing"]), 2),
        ):
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            got = call()
            peak = tracemalloc.get_traced_memory()[1] - base
            assert handles * n <= peak < handles * n + n // 2, (handles, peak)
            assert [None if h is None else bytes(h) for h in got][:2] == [value, value[::-1]][
                :handles
            ]
            del got
    finally:
        tracemalloc.stop()


def test_sessions(store):
    raw, ptr = _buf(16)
    ctypes.memmove(ptr, b"0123456789abcdef", 16)
    assert store.register_buffer(ptr, 16) == 0
    assert store.batch_put_session_start(["s1", "s2"], [8, 4]) == [0, 0]
    assert store.is_exist("s1") == 0  # not readable before the end
    assert store.batch_put_from_multi_buffer_ranges(["s1"], [[ptr, ptr + 8]], [[4, 4]],
                                                    [[4, 0]]) == [0]  # fmt: skip
    assert store.batch_put_from_multi_buffer_ranges(["s2"], [[ptr]], [[8]], [[0]]) == [-600]
    assert store.batch_put_session_revoke(["s2"]) == [0]
    assert store.batch_put_session_end(["s1", "s2"]) == [0, -704]
    assert store.get("s1") == b"89ab0123"
    assert store.batch_get_session_start(["s1", "nope"]) == [0, -704]
    assert store.batch_get_into_multi_buffer_ranges(["s1"], [[ptr, ptr + 2]], [[2, 2]],
                                                    [[0, 6]]) == [4]  # fmt: skip
    assert bytes(raw[:4]) == b"8923"
    assert store.batch_get_session_end(["s1"]) == 0


def test_query_and_remove(store):
    assert store.batch_put_from([], [], []) == []
    assert store.put_batch(["r1", "r2", "r3", "pre/a", "pre/b"], [b"1"] * 5) == 0
    assert store.is_exist("r1") == 1 and store.is_exist("no") == 0
    assert type(store.is_exist("r1")) is int
    assert store.batch_is_exist(["r1", "no"]) == [1, 0] and store.batch_is_exist([]) == []
    assert store.probe_key("r1") == 1 and store.batch_probe_key(["r2", "no"]) == [1, 0]
    assert store.get_size("r1") == 1 and store.get_size("no") == -704
    d = store.get_replica_desc("r1")
    assert len(d) == 1 and d[0].is_memory_replica() and d[0].status.name == "COMPLETE"
    assert d[0].get_memory_descriptor().buffer_descriptor.size == 1
    assert store.get_replica_desc("no") == []
    assert store.remove("r1") == -706  # get_replica_desc leased it, as a read does
    assert store.remove("r1", True) == 0 and store.is_exist("r1") == 0
    assert store.batch_remove(["r2", "no"]) == [0, -704]
    assert store.remove_by_regex("^pre/.*") == 2
    assert store.remove_by_regex("(a|b)") == -600 and store.remove_by_regex("[") == -600
    assert store.batch_replica_clear(["r3", "no"]) == ["r3"]
    assert store.put("again", b"1") == 0 and store.remove_all() >= 1
    assert store.create_copy_task("k", ["s"])[1] == -1012
    assert store.mount_segment("/dev/x", 1 << 20)["error_code"] == -1012
    seg = store.allocate_and_mount_segment(1 << 20)
    assert seg["error_code"] == 0
    assert store.unmount_and_free_segment([seg["segment_id"]]) == 0
    assert store.unmount_segment(["not-mine"]) == -101


def test_tensors(store, tmp_path):
    t = torch.arange(24, dtype=torch.float16).reshape(4, 6)
    assert store.put_tensor("t", t) == 0
    got = store.get_tensor("t")
    assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
    assert store.get_tensor("missing") is None and store.get("t")[:4] == b"NOOM"
    assert store.upsert_tensor("t", t * 2) in (0, -706)
    assert store.batch_put_tensor(["b1", "b2"], [t, t.int()]) == [0, 0]
    assert [x.dtype for x in store.batch_get_tensor(["b1", "b2"])] == [torch.float16, torch.int32]
    assert store.pub_tensor("p", t) == 0 and store.batch_pub_tensor(["p2"], [t]) == [0]
    assert store.put_tensor("bad", "not a tensor") == -600
    # TP: every shard key_tp_<r> on write, rank r's on read
    assert store.put_tensor_with_tp("tp", t, tp_size=2, split_dim=1) == 0
    assert torch.equal(store.get_tensor_with_tp("tp", tp_rank=1, tp_size=2), t[:, 3:])
    assert store.is_exist("tp_tp_0") == 1
    assert store.put_tensor_with_tp("tp5", t, tp_size=5) == -600  # not divisible
    r = store.batch_get_tensor_with_tp(["tp"], tp_rank=0, tp_size=2)
    assert torch.equal(r[0], t[:, :3])
    # buffers: a Mooncake tensor object in registered memory, both ways
    raw, ptr = _buf(1024)
    assert store.register_buffer(ptr, 1024) == 0
    into = store.get_tensor_into("t", ptr, 1024)
    assert into is not None and into.shape == t.shape
    n = len(store.get("p"))
    assert store.put_tensor_from("from", ptr, n) == 0 and torch.equal(
        store.get_tensor("from"), into
    )
    assert store.put_tensor_from("junk", ptr + 1, n) == -600
    assert store.batch_get_tensor_into(["p", "no"], [ptr, ptr + 512], [512, 512])[1] is None
    dst = torch.zeros(24, dtype=torch.float16)
    assert store.get_tensor_into_cuda("p", dst) == 48 and torch.equal(dst.view(4, 6), t)
    # parallelism: one TP axis
    par = TensorParallelism()
    ax = ParallelAxis()
    ax.kind, ax.rank, ax.size, ax.split_dim = "tp", 1, 2, 0
    par.axes = [ax]
    assert store.put_tensor_with_parallelism("par", t, par) == 0
    assert torch.equal(store.get_tensor_with_parallelism("par"), t[2:])
    target = ReadTarget()
    target.mode = "shard"
    target.parallelism = par
    assert torch.equal(store.get_tensor_with_parallelism("p", target), t[2:])
    ax.kind = "ep"
    assert store.put_tensor_with_parallelism("par2", t, par) == -1012
    # safetensors
    f = str(tmp_path / "t.safetensors")
    assert store.save_tensor_to_safetensor("p", f) == 0
    assert store.save_tensor_to_safetensor("missing", f) == -1100
    back = store.load_tensor_from_safetensor("loaded", f)
    assert torch.equal(back, t) and torch.equal(store.get_tensor("loaded"), t)
