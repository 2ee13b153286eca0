"""LMCache 0.5.x's own Mooncake store connector and lookup client, unmodified, on kvmesh.

Real client code, not a replay: LMCache's ``ConnectorManager`` builds its
``MooncakestoreConnector`` from a ``mooncakestore://`` URL with a real ``LocalCPUBackend``,
and the connector calls ``mooncake.store`` -- here kvmesh's compatibility surface
(:mod:`kvmesh.store.compat`, through the ``mooncake.store`` stand-in of
:mod:`kvmesh_sglang.mooncake_compat`) on this process's embedded store. Both of the
connector's data paths run: ``save_chunk_meta: False`` (``put_from`` / ``batch_put_from``
into and ``batch_get_into`` out of its registered CPU buffer) and the default ``True``
(``put_parts`` of LMCache's metadata header and the chunk, ``batch_get_buffer``). A miss
must come back as ``None`` (LMCache treats any buffer, even ``b""``, as a hit to decode).

Needs ``lmcache`` (scripts/setup.sh installs 0.5.6 without its CUDA dependencies; skipped
otherwise). numba, imported by LMCache's cachegen kernels only, is stood in for where absent
(tests/plugins/lmcache_env.py).
"""

from __future__ import annotations

import asyncio

import pytest

from .lmcache_env import install_numba_stub, lmcache_available

if not lmcache_available():
    pytest.skip(
        "lmcache or transformers not installed (scripts/setup.sh installs them; "
        "KVMESH_SKIP_LMCACHE=1 skips)",
        allow_module_level=True,
    )
install_numba_stub()

import torch  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector import ConnectorManager  # noqa: E402
from lmcache.v1.storage_backend.connector.mooncakestore_connector import (  # noqa: E402
    MooncakestoreConnector,
)
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402

from kvmesh.store import compat  # noqa: E402
from kvmesh_sglang import mooncake_compat  # noqa: E402

CHUNK = 16  # tokens per LMCache chunk
KV_SHAPE = (2, 2, CHUNK, 2, 8)  # (layers, k/v, tokens, kv heads, head size): 2 KiB a chunk


@pytest.fixture(autouse=True)
def mooncake():
    """``mooncake.store`` = kvmesh for the test (skipped over a real Mooncake)."""
    if not mooncake_compat.install():
        pytest.skip("a real Mooncake is installed; not shadowing it")
    try:
        import mooncake.store as store

        assert store.MooncakeDistributedStore is compat.MooncakeDistributedStore
        yield store
    finally:
        mooncake_compat.uninstall()


def _engine(save_chunk_meta: bool) -> tuple[LMCacheEngineConfig, LMCacheMetadata]:
    # Every setup value as LMCache passes it: strings, the mooncake_ prefix, sizes in
    # Mooncake's syntax; "embedded" is kvmesh's master address for the in-process store.
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=True,
        max_local_cpu_size=0.01,
        remote_url="mooncakestore://embedded",
        remote_serde="naive",
        extra_config={
            "save_chunk_meta": save_chunk_meta,
            "local_hostname": "127.0.0.1",
            "metadata_server": "P2PHANDSHAKE",
            "mooncake_master_server_address": "embedded",
            "mooncake_global_segment_size": "64MB",
            "mooncake_local_buffer_size": "16 MB",
            "mooncake_prefer_local_alloc": True,
            "transfer_timeout": 30,
        },
    )
    md = LMCacheMetadata(
        model_name="kvmesh-test",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=KV_SHAPE,
        chunk_size=CHUNK,
    )
    return cfg, md


class _Run:
    """A connector built the way LMCache's storage manager builds it, and its event loop."""

    def __init__(self, save_chunk_meta: bool) -> None:
        self.cfg, self.md = _engine(save_chunk_meta)
        self.backend = LocalCPUBackend(self.cfg, self.md)
        self.loop = asyncio.new_event_loop()
        manager = ConnectorManager(self.cfg.remote_url, self.loop, self.backend, self.cfg, self.md)
        self.conn = manager.create_connector()

    def __call__(self, coro):
        return self.loop.run_until_complete(coro)

    def chunk(self, seed: int):
        """A full chunk of this backend's memory, filled with seeded random bytes."""
        obj = self.backend.allocate(self.md.get_shapes(), self.md.get_dtypes())
        assert obj is not None
        g = torch.Generator().manual_seed(seed)
        raw = obj.raw_tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        return obj, bytes(obj.byte_array)

    def close(self) -> None:
        try:
            self(self.conn.close())
        finally:
            self.backend.close()
            self.loop.close()


@pytest.fixture
def run(request):
    r = _Run(request.param)
    yield r
    r.close()


def _key(h: int) -> CacheEngineKey:
    return CacheEngineKey("kvmesh-test", 1, 0, h, torch.bfloat16)


@pytest.mark.parametrize("run", [False, True], ids=["get_into", "chunk_meta"], indirect=True)
def test_chunks_round_trip_byte_exact(run):
    conn = run.conn
    assert type(conn) is MooncakestoreConnector
    assert conn.save_chunk_meta is (run.cfg.extra_config["save_chunk_meta"])
    # Its CPU buffer is registered (put_from/batch_get_into need it) and prefer_local_alloc
    # named this store's own segment.
    assert conn.registered_buffer_ptr is not None
    assert conn.replica_config.replica_num == 1
    assert conn.replica_config.preferred_segment == conn.store.get_hostname() != ""

    one, one_bytes = run.chunk(1)
    run(conn.put(_key(1), one))  # put_from, or put_parts(header, chunk)
    objs = [run.chunk(10 + i) for i in range(3)]
    run(conn.batched_put([_key(10 + i) for i in range(3)], [o for o, _ in objs]))

    assert conn.exists_sync(_key(1)) == 1
    assert conn.exists_sync(_key(99)) == 0  # a miss is exactly 0: LMCache tests truthiness
    assert run(conn.exists(_key(11))) == 1
    keys = [_key(10), _key(11), _key(99), _key(12)]
    assert run(conn.batched_async_contains("lookup-1", keys)) == 2  # prefix up to the miss

    got = run(conn.batched_get([_key(1), _key(10), _key(99), _key(11), _key(12)]))
    assert len(got) == 5
    assert got[2] is None  # the miss
    for obj, want in zip([got[0], got[1], got[3], got[4]], [one_bytes] + [b for _, b in objs]):
        assert obj is not None
        assert obj.get_shapes() == run.md.get_shapes() and obj.get_dtypes() == [torch.bfloat16]
        assert bytes(obj.byte_array) == want
    assert [run(conn.batched_get([_key(99)]))] == [[None]]
    # The contract the connector's code tests (``if buffer is None``), asked of the store it
    # holds: a missing key is None. LMCache 0.5.6 would also turn a b"" into None through
    # its header-length check, so the connector's result alone does not show it.
    assert conn.store.batch_get_buffer([_key(99).to_string()]) == [None]


@pytest.mark.parametrize("run", [False], ids=["get_into"], indirect=True)
def test_lookup_client_counts_stored_prefix(run):
    """LMCache's ``MooncakeLookupClient`` (the scheduler's lookup: its own store with no
    segment, legacy string setup, ``batch_is_exist`` where only 1 counts) finds the chunks
    the connector stored, keyed by LMCache's token database."""
    from lmcache.v1.lookup_client.mooncake_lookup_client import MooncakeLookupClient
    from lmcache.v1.token_database import ChunkedTokenDatabase

    tokens = list(range(1000, 1000 + 3 * CHUNK + 5))  # three full chunks and a partial one
    db = ChunkedTokenDatabase(run.cfg, run.md)
    spans = [(end, key) for _start, end, key in db.process_tokens(tokens)]
    assert [end for end, _ in spans] == [CHUNK, 2 * CHUNK, 3 * CHUNK]  # no partial chunk saved
    for i, (_, key) in enumerate(spans[:2]):
        obj, _ = run.chunk(100 + i)
        run(run.conn.put(key, obj))

    client = MooncakeLookupClient(run.cfg, run.md, "embedded")
    try:
        assert client.store.get_hostname() != run.conn.store.get_hostname()
        assert client.lookup(tokens) == spans[1][0] == 2 * CHUNK
        assert client.lookup(tokens[CHUNK:]) == 0  # other prefix, other hashes
        obj, _ = run.chunk(102)
        run(run.conn.put(spans[2][1], obj))
        assert client.lookup(tokens) == 3 * CHUNK
    finally:
        client.close()
        assert client.store.close() == 0
