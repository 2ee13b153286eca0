"""Mooncake's value types, constants, setup parsing and tensor format in kvmesh.store.compat:
no store needed. The tensor header is checked against the byte offsets of Mooncake's
``TensorMetadata`` (``integration_utils.h``), packed here field by field."""

from __future__ import annotations

import struct

import pytest

from kvmesh.store import compat
from kvmesh.store.compat import (
    BufferHandle,
    MooncakeDistributedStore,
    ObjectDataType,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
)
from kvmesh.store.compat import tensors as T
from kvmesh.store.compat.config import from_dict, parse_mooncake_size

# Mooncake 0.3.13's MooncakeDistributedStore methods (+ 0.3.14's probe_key/batch_probe_key),
# from the wheel's pybind signatures.
MOONCAKE_METHODS = [
    "alloc_from_mem_pool",
    "allocate_and_mount_segment",
    "batch_get_buffer",
    "batch_get_into",
    "batch_get_into_multi_buffer_ranges",
    "batch_get_into_multi_buffers",
    "batch_get_replica_desc",
    "batch_get_session_end",
    "batch_get_session_start",
    "batch_get_tensor",
    "batch_get_tensor_into",
    "batch_get_tensor_into_cuda",
    "batch_get_tensor_with_parallelism",
    "batch_get_tensor_with_parallelism_into",
    "batch_get_tensor_with_tp",
    "batch_get_tensor_with_tp_into",
    "batch_is_exist",
    "batch_probe_key",
    "batch_pub_tensor",
    "batch_pub_tensor_with_tp",
    "batch_put_from",
    "batch_put_from_multi_buffer_ranges",
    "batch_put_from_multi_buffers",
    "batch_put_session_end",
    "batch_put_session_revoke",
    "batch_put_session_start",
    "batch_put_tensor",
    "batch_put_tensor_from",
    "batch_put_tensor_with_parallelism",
    "batch_put_tensor_with_parallelism_from",
    "batch_put_tensor_with_tp",
    "batch_put_tensor_with_tp_from",
    "batch_remove",
    "batch_replica_clear",
    "batch_upsert_from",
    "batch_upsert_pub_tensor",
    "batch_upsert_tensor",
    "batch_upsert_tensor_from",
    "batch_upsert_tensor_with_parallelism",
    "batch_upsert_tensor_with_parallelism_from",
    "close",
    "create_copy_task",
    "create_move_task",
    "get",
    "get_batch",
    "get_buffer",
    "get_hostname",
    "get_into",
    "get_into_ranges",
    "get_offload_rpc_read_count",
    "get_replica_desc",
    "get_size",
    "get_tensor",
    "get_tensor_into",
    "get_tensor_into_cuda",
    "get_tensor_with_parallelism",
    "get_tensor_with_parallelism_into",
    "get_tensor_with_tp",
    "get_tensor_with_tp_into",
    "health_check",
    "init_all",
    "is_exist",
    "load_tensor_from_safetensor",
    "mount_segment",
    "probe_key",
    "pub_tensor",
    "pub_tensor_with_tp",
    "put",
    "put_batch",
    "put_from",
    "put_from_with_metadata",
    "put_parts",
    "put_tensor",
    "put_tensor_from",
    "put_tensor_with_parallelism",
    "put_tensor_with_parallelism_from",
    "put_tensor_with_tp",
    "put_tensor_with_tp_from",
    "query_task",
    "register_buffer",
    "remove",
    "remove_all",
    "remove_by_regex",
    "save_tensor_to_safetensor",
    "setup",
    "setup_dummy",
    "unmount_and_free_segment",
    "unmount_local_disk_segment",
    "unmount_segment",
    "unregister_buffer",
    "upsert",
    "upsert_batch",
    "upsert_from",
    "upsert_parts",
    "upsert_pub_tensor",
    "upsert_tensor",
    "upsert_tensor_from",
    "upsert_tensor_with_parallelism",
    "upsert_tensor_with_parallelism_from",
]

MODULE_NAMES = [
    "ACTIVATION",
    "BufferHandle",
    "COMPLETE",
    "Descriptor",
    "DiskDescriptor",
    "FAILED",
    "GENERAL",
    "GRADIENT",
    "INITIALIZED",
    "KVCACHE",
    "METADATA",
    "MemoryDescriptor",
    "OPTIMIZER_STATE",
    "ObjectDataType",
    "PENDING",
    "PROCESSING",
    "ParallelAxis",
    "QueryTaskResponse",
    "REMOVED",
    "REPLICA_COPY",
    "REPLICA_MOVE",
    "ReadTarget",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "ReplicateConfig",
    "SAMPLE",
    "SUCCESS",
    "SoftPinAction",
    "TENSOR",
    "TaskStatus",
    "TaskType",
    "TensorParallelism",
    "UNDEFINED",
    "UNKNOWN",
    "WEIGHT",
    "bind_to_numa_node",
]


def test_every_mooncake_method_and_name_exists():
    missing = [
        m for m in MOONCAKE_METHODS if not callable(getattr(MooncakeDistributedStore, m, None))
    ]
    assert missing == []
    names = compat.module_names()
    assert [n for n in MODULE_NAMES if n not in names] == []


def test_not_set_up_answers_codes_never_raises():
    s = MooncakeDistributedStore()
    assert s.put("k", b"v") == -600 and type(s.put("k", b"v")) is int
    assert s.get("k") == b"" and s.get_buffer("k") is None
    assert s.batch_is_exist(["a", "b"]) == [-600, -600]
    assert s.batch_get_buffer(["a"]) == [None]
    assert s.get_tensor("k") is None
    assert s.health_check() == 1 and s.close() == 0


def test_replicate_config_attributes_and_types():
    c = ReplicateConfig()
    assert (c.replica_num, c.soft_pin_action, c.soft_pin_ttl_ms) == (
        1,
        SoftPinAction.PRESERVE,
        None,
    )
    assert c.preferred_segment == "" and c.preferred_segments == [] and c.group_ids is None
    assert c.with_hard_pin is False and c.data_type == ObjectDataType.UNKNOWN
    assert (c.nof_replica_num, c.dfs_replica_num, c.prefer_alloc_in_same_node) == (0, 0, False)
    c.soft_pin_ttl_ms = 1000
    assert c.soft_pin_ttl_ms == 1000
    c.soft_pin_ttl_ms = None
    for bad in (-1, 1 << 64, "1"):
        with pytest.raises(TypeError):
            c.soft_pin_ttl_ms = bad
    with pytest.raises(TypeError):
        c.replica_num = "2"
    with pytest.raises(TypeError):
        c.group_ids = "abc"  # a str is not a list of ids
    with pytest.raises(AttributeError):
        c.no_such_attribute = 1
    c.replica_num = 3
    c.with_soft_pin = True  # the older spelling
    assert c.soft_pin_action == SoftPinAction.ENABLE and "3" in str(c)


def test_enum_values_are_mooncakes():
    assert [int(x) for x in SoftPinAction] == [0, 1, 2]
    assert int(ReplicaStatus.COMPLETE) == 3 and int(ReplicaStatus.FAILED) == 5
    assert int(ObjectDataType.KVCACHE) == 1 and int(ObjectDataType.GENERAL) == 9
    assert compat.module_names()["COMPLETE"] is ReplicaStatus.COMPLETE


def test_buffer_handle_holds_its_bytes():
    import ctypes

    h = BufferHandle(b"hello world")
    assert h.size() == len(h) == 11 and bytes(h) == b"hello world"
    assert bytes(memoryview(h)) == b"hello world"
    assert ctypes.string_at(h.ptr(), 11) == b"hello world"
    assert BufferHandle().ptr() == 0


@pytest.mark.parametrize(
    ("text", "want"),
    [("16MB", 16 << 20), ("16 MB", 16 << 20), ("1GB", 1 << 30), ("1.5 gb", 3 << 29),
     ("512k", 512 << 10), ("4096", 4096), (" 2 T ", 2 << 40), ("7b", 7)],
)  # fmt: skip
def test_mooncake_size_syntax(text, want):
    assert parse_mooncake_size(text) == want


@pytest.mark.parametrize("text", ["50%", "", "MB", "-1MB", "16 MiB", "1e", "abc"])
def test_mooncake_size_syntax_refused(text):
    assert parse_mooncake_size(text) is None


def test_setup_refusals_are_codes_or_type_errors():
    s = MooncakeDistributedStore()
    base = {"local_hostname": "localhost", "metadata_server": "x", "master_server_addr": "embedded"}
    assert s.setup({**base, "global_segment_size": "50%"}) == -600
    assert type(s.setup({**base, "local_buffer_size": "lots"})) is int
    assert from_dict({**base, "global_segment_size": 1 << 20}).global_segment_size == 1 << 20
    for bad in ((123,), ("localhost",), ("h", "m", "16MB", 0, "tcp", "", "embedded")):
        with pytest.raises(TypeError):
            s.setup(*bad)
    assert s.setup("h", "m", 0, 0, "tcp", "", "embedded", object()) == -1012  # Mooncake's engine
    assert s.close() == 0


def _mooncake_header(dtype, shape, local, kind, axes, nbytes):
    """Mooncake's TensorMetadata at its byte offsets (integration_utils.h)."""
    b = bytearray(304)
    struct.pack_into("<IHH", b, 0, 0x4D4F4F4E, 1, 304)  # magic, version, header_size
    struct.pack_into("<iiII", b, 8, dtype, len(shape), kind, 0)  # dtype, ndim, layout, flags
    struct.pack_into("<QQ", b, 24, 304, nbytes)  # data_offset, data_bytes
    struct.pack_into("<8q", b, 40, *shape, *[-1] * (8 - len(shape)))  # global_shape
    struct.pack_into("<8q", b, 104, *local, *[-1] * (8 - len(local)))  # local_shape
    struct.pack_into("<II", b, 168, len(axes), 0)  # axis_count
    for i, ax in enumerate(axes):  # LayoutAxis: 6 x i32, i64
        struct.pack_into("<iiiiiiq", b, 176 + 32 * i, *ax, 0, 0)
    return bytes(b)


def test_tensor_header_is_mooncakes_layout():
    torch = pytest.importorskip("torch")
    t = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
    h = T.full_header(t)
    assert T.encode(h) == _mooncake_header(12, (2, 3, 4), (2, 3, 4), 0, (), 48)
    part, hs = T.shard(t, 1, 2, 2)
    assert T.encode(hs) == _mooncake_header(12, (2, 3, 4), (2, 3, 2), 1, [(1, 0, 1, 2, 2)], 24)
    # a Mooncake-written object decodes to the same dtype and shape
    obj = _mooncake_header(6, (2, 2), (2, 2), 0, (), 16) + struct.pack("<4i", 1, 2, 3, 4)
    back = T.tensor_from(obj, T.decode(obj))
    assert back.dtype == torch.int32 and back.tolist() == [[1, 2], [3, 4]]
    assert T.decode(obj[:-1]) is None  # data_bytes must match
    assert T.decode(b"\0" * 304) is None
