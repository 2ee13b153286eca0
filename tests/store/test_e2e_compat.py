"""The Mooncake-compatible class driven the way SGLang's Mooncake HiCache backend drives it:
setup (positional and config-dict forms), warm-up put/is_exist/get, registering the host KV
pool by pointer, batch_is_exist, zero-copy batch_put_from / batch_get_into of K and V page
objects, the multi-buffer forms, Mooncake's integer results for error cases, remove_all."""

from __future__ import annotations

import pytest

from kvmesh.store.cluster import StoreCluster
from kvmesh.store.compat import MooncakeDistributedStore, ReplicateConfig

from .e2e_util import TOKEN

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = StoreCluster(
        str(tmp_path_factory.mktemp("compat")),
        1,
        durability="memory",
        extra_args=["--lease-ttl-s", "0.5"],
    )
    cl.start_all()
    yield cl
    cl.close()


def test_sglang_style_session(cluster):
    store = MooncakeDistributedStore()
    # SGLang's positional call: hostname, metadata server, segment, local buffer, protocol,
    # device, master address, transfer engine.
    rc = store.setup(
        "localhost", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", cluster.address, None
    )
    assert rc == 0
    try:
        # warm-up exactly as the backend does it
        assert store.put("warmup", bytes(4096)) == 0
        assert store.is_exist("warmup") == 1
        assert store.get("warmup") == bytes(4096)
        # host KV pool: pages of K and V, registered once by pointer
        pages, page_bytes = 16, 8192
        pool = torch.randint(0, 255, (2 * pages, page_bytes), dtype=torch.uint8)
        assert store.register_buffer(pool.data_ptr(), pool.numel()) == 0
        keys = [f"h{i}_0_{kv}" for i in range(pages) for kv in ("k", "v")]
        ptrs = [pool[i].data_ptr() for i in range(2 * pages)]
        sizes = [page_bytes] * (2 * pages)
        assert store.batch_is_exist(keys) == [0] * len(keys)
        assert store.batch_put_from(keys, ptrs, sizes) == [0] * len(keys)
        assert store.batch_is_exist(keys + ["absent"]) == [1] * len(keys) + [0]
        # read back into another registered region
        dst = torch.zeros_like(pool)
        assert store.register_buffer(dst.data_ptr(), dst.numel()) == 0
        dptrs = [dst[i].data_ptr() for i in range(2 * pages)]
        assert store.batch_get_into(keys, dptrs, sizes) == sizes
        assert torch.equal(dst, pool)
        # Mooncake's integer results for the error cases
        assert store.put("warmup", b"x") == 0  # exists: 0 like Mooncake, the object stays
        assert store.get("warmup") == bytes(4096)
        assert store.get("absent") == b""
        assert store.get_into("absent", dptrs[0], page_bytes) == -704
        assert store.get_into(keys[0], dptrs[0], 100) == -10  # buffer too small
        assert store.get_size(keys[0]) == page_bytes and store.get_size("absent") == -704
        assert store.remove(keys[0]) in (0, -706)  # leased by the read above, or removed
        # multi-buffer objects (one object across several pieces)
        cfg = ReplicateConfig()
        cfg.replica_num = 1
        mkeys = ["multi-a", "multi-b"]
        mptrs = [[pool[0].data_ptr(), pool[1].data_ptr()], [pool[2].data_ptr()]]
        msizes = [[page_bytes, page_bytes], [page_bytes]]
        assert store.batch_put_from_multi_buffers(mkeys, mptrs, msizes, cfg) == [0, 0]
        out = torch.zeros(4, page_bytes, dtype=torch.uint8)
        assert store.register_buffer(out.data_ptr(), out.numel()) == 0
        got = store.batch_get_into_multi_buffers(
            mkeys, [[out[0].data_ptr(), out[1].data_ptr()], [out[2].data_ptr()]], msizes
        )
        assert got == [2 * page_bytes, page_bytes]
        assert torch.equal(out[:3], pool[:3])
        assert store.unregister_buffer(out.data_ptr()) == 0
        assert store.get_into("multi-b", out.data_ptr(), page_bytes) < 0  # no longer registered
        assert store.remove_all(True) >= 2 * pages
        assert store.batch_is_exist(keys[:4]) == [0, 0, 0, 0]
    finally:
        assert store.close() == 0


def test_config_dict_setup_and_embedded():
    store = MooncakeDistributedStore()
    assert (
        store.setup(
            {
                "local_hostname": "localhost",
                "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": 16 << 20,
                "protocol": "tcp",
                "master_server_address": "embedded",
            }
        )
        == 0
    )
    try:
        assert store.put("dict-a", b"hello") == 0
        assert store.get("dict-a") == b"hello"
        assert store.upsert("dict-a", b"HELLO!") in (0, -706)  # the get leased it
        with pytest.raises(TypeError):  # no overload fits, as pybind11 answers in Mooncake
            store.setup("again")
        assert store.setup({"local_hostname": "h", "metadata_server": "m"}) != 0  # twice
    finally:
        store.close()


def test_wrong_master_token_gives_codes_not_exceptions(cluster, monkeypatch):
    monkeypatch.setenv("KVMESH_TOKEN", TOKEN)  # the cluster runs without a token: mismatch
    store = MooncakeDistributedStore()
    rc = store.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", cluster.address)
    assert rc == 0  # no segment: nothing contacted yet
    try:
        assert store.is_exist("x") < 0
        assert store.put("x", b"1") < 0
        assert store.get("x") == b""
    finally:
        store.close()
