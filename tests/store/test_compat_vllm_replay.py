"""vLLM's ``MooncakeStoreConnector`` call sequence on kvmesh's Mooncake surface: a REPLAY.

vLLM's store connector (``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/``,
its ``worker.py``) cannot run here: it needs vLLM itself, ``torch.cuda`` (a CUDA event fences
every save) and KV caches in GPU memory. So this test makes the same calls on
``kvmesh.store.compat.MooncakeDistributedStore``, in its order, with its argument forms and
reading the results as vLLM reads them, on CPU tensors laid out as vLLM's FlashAttention KV
caches are (per layer ``(2, num_blocks, block_size, kv_heads, head_size)``, K/V split into
two segments by stride):

* ``MooncakeStoreWorker.__init__``: positional ``setup(local_hostname, metadata_server,
  global_segment_size, local_buffer_size, protocol, device_name, master_server_address)``
  with int sizes, ``ret != 0`` is fatal; a ``ReplicateConfig()`` with ``preferred_segment``
  when configured.
* ``register_kv_caches``: ``register_buffer(storage.data_ptr(), storage.nbytes())`` once per
  distinct storage, ``ret != 0`` logged.
* the sending thread: ``batch_is_exist(keys)`` (only ``== 1`` counts as stored), then for the
  missing keys ``replicate_config.group_ids = [one per key]`` (with group semantics) and
  ``batch_put_from_multi_buffers(keys, addrs[][], sizes[][], replicate_config)``, a value
  ``< 0`` a failed key.
* the receiving thread: ``batch_get_replica_desc(keys)`` (tier logging: ``.get(key)``, then
  ``[0].is_memory_replica()`` / ``is_disk_replica()``), ``batch_get_into_multi_buffers(keys,
  addrs, sizes)``, a value ``>= 0`` bytes read, ``< 0`` a failed block.
* lookup: ``batch_is_exist`` over the keys of every rank namespace; reset:
  ``remove_all(force=True)``; teardown: ``close()``.

Two ranks (TP=2, MLA-like: both ranks hold the same bytes, so they share one key namespace
and stripe the puts, rank ``r`` putting the blocks ``i % 2 == r``) and a consumer instance,
each its own store in this process on its embedded master.
"""

from __future__ import annotations

import pytest

from kvmesh.store.compat import MooncakeDistributedStore, ReplicateConfig

torch = pytest.importorskip("torch")

LAYERS, BLOCKS, BLOCK_TOKENS, HEADS, HEAD = 2, 8, 16, 2, 8
MODEL = "Llama-3.2-1B"


def _setup(host: str) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    ret = store.setup(host, "P2PHANDSHAKE", 32 << 20, 16 << 20, "rdma", "", "embedded")
    assert ret == 0, ret  # vLLM raises RuntimeError on anything else
    return store


class _Rank:
    """One vLLM worker: its store and KV caches, with vLLM's segment addresses."""

    def __init__(self, host: str, seed: int | None) -> None:
        self.store = _setup(host)
        g = torch.Generator().manual_seed(seed or 0)
        self.caches = []
        for _ in range(LAYERS):
            t = torch.zeros((2, BLOCKS, BLOCK_TOKENS, HEADS, HEAD), dtype=torch.bfloat16)
            if seed is not None:
                t.view(torch.int16).copy_(
                    torch.randint(-(1 << 15), 1 << 15, t.shape, dtype=torch.int16, generator=g)
                )
            self.caches.append(t)
        self.segs: list[int] = []  # vLLM: one segment per K and per V of each layer
        self.block_len = 0
        for t in self.caches:
            st = t.untyped_storage()
            assert self.store.register_buffer(st.data_ptr(), st.nbytes()) == 0
            seg_stride = t.stride(0) * t.element_size()  # the K/V dim: stride > page size
            self.segs += [st.data_ptr() + i * seg_stride for i in range(t.shape[0])]
            self.block_len = seg_stride // BLOCKS

    def values(self, block_ids: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """vLLM's ``prepare_values``: per block, its address in every segment."""
        addrs = [[s + b * self.block_len for s in self.segs] for b in block_ids]
        return addrs, [[self.block_len] * len(self.segs) for _ in block_ids]

    def block(self, b: int) -> bytes:
        return b"".join(
            bytes(t[kv, b].contiguous().view(torch.uint8).numpy())
            for t in self.caches
            for kv in (0, 1)
        )


def _key(chunk_hash: str) -> str:
    # vLLM's PoolKey: prefix (model, tp/pcp/dcp/pp ranks, KV cache group) @ the chunk hash.
    return f"{MODEL}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{chunk_hash}"


def _group_id(chunk_hash: str) -> str:
    return f"vllm-mooncake-store:{MODEL}@{chunk_hash}"  # no TP shard, no KV cache group


@pytest.fixture
def ranks():
    made: list[_Rank] = []
    try:
        made += [_Rank("127.0.0.1", 1), _Rank("127.0.0.1", 1), _Rank("127.0.0.1", None)]
        yield made
    finally:
        if made:
            made[0].store.remove_all(True)
        for r in made:
            assert r.store.close() == 0


def test_vllm_store_connector_call_sequence(ranks):
    r0, r1, consumer = ranks
    assert r0.block(3) == r1.block(3)  # MLA: both TP ranks hold the same bytes
    hashes = [f"{i:064x}" for i in (0xA1, 0xB2, 0xC3, 0xD4)]
    src_blocks = [3, 5, 6, 1]
    keys = [_key(h) for h in hashes]

    # Each rank's sending thread: dedup, then put its stripe with group ids and the owner
    # segment as preferred_segment (vLLM's configured one; here rank 0's).
    owner = r0.store.get_hostname()
    for rank, r in enumerate((r0, r1)):
        cfg = ReplicateConfig()
        cfg.preferred_segment = owner
        assert hasattr(cfg, "group_ids")  # vLLM probes for the field before setting it
        mine = [i for i in range(len(keys)) if i % 2 == rank]
        exists = r.store.batch_is_exist([keys[i] for i in mine])
        missing = [mine[j] for j, e in enumerate(exists) if e != 1]
        assert missing == mine
        addrs, sizes = r.values([src_blocks[i] for i in missing])
        cfg.group_ids = [_group_id(hashes[i]) for i in missing]
        res = r.store.batch_put_from_multi_buffers([keys[i] for i in missing], addrs, sizes, cfg)
        assert res == [0] * len(missing), res
        # Saving again: every key exists (== 1), nothing is put.
        assert r.store.batch_is_exist([keys[i] for i in mine]) == [1] * len(mine)
        # A group_ids list not one per key is refused per key, not raised.
        cfg.group_ids = ["g"]
        assert r.store.batch_put_from_multi_buffers(["x1", "x2"], addrs, sizes, cfg) == [-600] * 2

    # Scheduler lookup through rank 0: every key of the shared namespace is there.
    assert r0.store.batch_is_exist(keys + [_key("f" * 64)]) == [1, 1, 1, 1, 0]

    # The consumer's receiving thread: tiers, then the whole request into other blocks.
    dst_blocks = [0, 2, 4, 7]
    descs = consumer.store.batch_get_replica_desc(keys)
    for k in keys:
        reps = descs.get(k)
        assert reps and reps[0].is_memory_replica() and not reps[0].is_disk_replica()
        assert reps[0].segment_name == owner  # preferred_segment placed the copy
    addrs, sizes = consumer.values(dst_blocks)
    res = consumer.store.batch_get_into_multi_buffers(keys, addrs, sizes)
    assert res == [sum(s) for s in sizes]  # bytes read, >= 0
    for src, dst in zip(src_blocks, dst_blocks):
        assert consumer.block(dst) == r0.block(src)
    untouched = set(range(BLOCKS)) - set(dst_blocks)
    assert all(consumer.block(b) == bytes(len(r0.block(0))) for b in untouched)
    # A missing key fails that key (vLLM marks its block as a load error), others load.
    a2, s2 = consumer.values([5, 6])
    res = consumer.store.batch_get_into_multi_buffers([_key("e" * 64), keys[0]], a2, s2)
    assert res[0] < 0 and res[1] == sum(s2[1])
    assert consumer.block(5) == bytes(len(r0.block(0))) and consumer.block(6) == r0.block(3)

    # Reset (RL step boundary): remove_all(force=True) on rank 0 wipes the key space.
    assert r0.store.remove_all(force=True) >= len(keys)
    assert consumer.store.batch_is_exist(keys) == [0] * len(keys)
    assert consumer.store.batch_get_replica_desc(keys) == {k: [] for k in keys}
