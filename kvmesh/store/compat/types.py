"""Mooncake's value classes: ``ReplicateConfig`` (every attribute of Mooncake 0.3.13's),
``BufferHandle``, the replica descriptors, the parallelism specs and the task response.

``ReplicateConfig`` validates where a value is set, as Mooncake's pybind11 binding does: a
wrong-typed value raises ``TypeError`` at the assignment, never later inside a store call.
"""

from __future__ import annotations

import ctypes
from typing import Any

from .constants import ObjectDataType, ReplicaStatus, SoftPinAction

__all__ = [
    "BufferHandle",
    "Descriptor",
    "DiskDescriptor",
    "MemoryDescriptor",
    "ParallelAxis",
    "QueryTaskResponse",
    "ReadTarget",
    "ReplicaDescriptor",
    "ReplicateConfig",
    "TensorParallelism",
]

_U64 = 1 << 64


def _uint(v: Any, what: str) -> int:
    if type(v) is bool or not isinstance(v, int) or not 0 <= v < _U64:
        raise TypeError(f"ReplicateConfig.{what} must be an unsigned 64-bit int, got {v!r}")
    return int(v)


def _strs(v: Any, what: str) -> list[str]:
    if isinstance(v, (str, bytes)) or not all(isinstance(x, str) for x in v):
        raise TypeError(f"ReplicateConfig.{what} must be a list of str, got {v!r}")
    return list(v)


class ReplicateConfig:
    """Mooncake's mutable ``ReplicateConfig``. What kvmesh does with each attribute:

    * ``replica_num``: copies, each on a distinct storage node (each store is one).
    * ``soft_pin_action`` / ``soft_pin_ttl_ms``: ``ENABLE`` soft-pins (for the master's pin
      TTL: kvmesh has no per-request TTL), ``PRESERVE`` / ``DISABLE`` do not pin; a TTL with
      anything but ``ENABLE`` is refused with -600, as Mooncake's master refuses it.
    * ``with_hard_pin``: never evicted. ``with_soft_pin`` (Mooncake before 0.3.13, SGLang
      sets it): ``True`` is ``soft_pin_action = ENABLE``.
    * ``preferred_segment`` / ``preferred_segments``: the first copy's segment (a name from
      :meth:`MooncakeDistributedStore.get_hostname`).
    * ``group_ids``: one id per key of a batch (else -600); accepted, and otherwise not
      used: kvmesh's master has one shard, so there is no routing to group.
    * ``nof_replica_num``, ``dfs_replica_num``, ``preferred_nof_segments``: NVMe-oF and DFS
      copies do not exist on kvmesh; a non-zero count is refused with -1012.
    * ``prefer_alloc_in_same_node``, ``data_type``: accepted; kvmesh places copies on the
      writer's host first anyway, and keeps no data type.
    """

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms = None
        self.with_hard_pin = False
        self.preferred_segments = []
        self.preferred_nof_segments = []
        self.preferred_segment = ""
        self.prefer_alloc_in_same_node = False
        self.data_type = ObjectDataType.UNKNOWN
        self.group_ids = None

    def __setattr__(self, name: str, v: Any) -> None:
        if name in ("replica_num", "nof_replica_num", "dfs_replica_num"):
            v = _uint(v, name)
        elif name == "soft_pin_ttl_ms":
            v = None if v is None else _uint(v, name)
        elif name == "soft_pin_action":
            if not isinstance(v, SoftPinAction):
                raise TypeError(f"soft_pin_action must be a SoftPinAction, got {v!r}")
        elif name == "data_type":
            if not isinstance(v, ObjectDataType):
                raise TypeError(f"data_type must be an ObjectDataType, got {v!r}")
        elif name in ("with_hard_pin", "prefer_alloc_in_same_node"):
            if type(v) is not bool:
                raise TypeError(f"ReplicateConfig.{name} must be a bool, got {v!r}")
        elif name == "with_soft_pin":  # the pre-0.3.13 spelling
            if type(v) is not bool:
                raise TypeError(f"ReplicateConfig.with_soft_pin must be a bool, got {v!r}")
            name, v = "soft_pin_action", SoftPinAction.ENABLE if v else SoftPinAction.PRESERVE
        elif name == "preferred_segment":
            if not isinstance(v, str):
                raise TypeError(f"preferred_segment must be a str, got {v!r}")
        elif name in ("preferred_segments", "preferred_nof_segments"):
            v = _strs(v, name)
        elif name == "group_ids":
            v = None if v is None else _strs(v, name)
        else:
            raise AttributeError(f"ReplicateConfig has no attribute {name!r}")
        object.__setattr__(self, name, v)

    @property
    def with_soft_pin(self) -> bool:
        return self.soft_pin_action == SoftPinAction.ENABLE

    def __str__(self) -> str:
        return (
            f"ReplicateConfig: {{ replica_num: {self.replica_num}, nof_replica_num: "
            f"{self.nof_replica_num}, dfs_replica_num: {self.dfs_replica_num}, "
            f"soft_pin_action: {self.soft_pin_action.name}, soft_pin_ttl_ms: "
            f"{self.soft_pin_ttl_ms}, with_hard_pin: {self.with_hard_pin}, "
            f"preferred_segments: {self.preferred_segments}, preferred_segment: "
            f"{self.preferred_segment!r}, group_ids: {self.group_ids} }}"
        )

    __repr__ = __str__


class BufferHandle(bytearray):
    """Bytes read by ``get_buffer``: the buffer protocol (``bytes(h)``, ``memoryview(h)``),
    ``len``, ``size()`` and ``ptr()``, an address valid while the handle lives (it holds its
    memory, and a handle whose address was taken cannot be resized)."""

    def size(self) -> int:
        return len(self)

    def ptr(self) -> int:
        if not len(self):
            return 0
        pin = self.__dict__.get("_pin")
        if pin is None:
            pin = self.__dict__["_pin"] = (ctypes.c_char * len(self)).from_buffer(self)
        return ctypes.addressof(pin)


class Descriptor:
    """A buffer of a replica: ``size``, ``buffer_address`` (the offset in its segment on
    kvmesh) and ``transport_endpoint`` (the segment owner's transfer endpoint)."""

    def __init__(self, size: int = 0, buffer_address: int = 0, transport_endpoint: str = ""):
        self.size = size
        self.buffer_address = buffer_address
        self.transport_endpoint = transport_endpoint

    def __repr__(self) -> str:
        return (
            f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
            f"transport_endpoint={self.transport_endpoint}>"
        )


class MemoryDescriptor:
    def __init__(self, buffer_descriptor: Descriptor) -> None:
        self.buffer_descriptor = buffer_descriptor


class DiskDescriptor:
    def __init__(self, file_path: str = "", object_size: int = 0) -> None:
        self.file_path = file_path
        self.object_size = object_size


class ReplicaDescriptor:
    """One COMPLETE copy. kvmesh returns memory copies only (its disk tier is the node's
    business); a copy in several slices is described by its first slice, with the whole
    size."""

    def __init__(self, memory: MemoryDescriptor, segment: str = "") -> None:
        self.status = ReplicaStatus.COMPLETE
        self._memory = memory
        self.segment_name = segment

    def is_memory_replica(self) -> bool:
        return True

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        return self._memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        raise RuntimeError("not a disk replica")  # Mooncake's binding raises here too

    def __repr__(self) -> str:
        return f"ReplicaDescriptor(status={self.status.name}, {self._memory.buffer_descriptor})"


class ParallelAxis:
    """One axis of a tensor's parallel layout: ``kind`` ("tp", "dp", "ep", "pp"), this
    process's ``rank`` of ``size``, the ``split_dim`` it shards (None: replicated)."""

    def __init__(self) -> None:
        self.kind = ""
        self.rank = 0
        self.size = 1
        self.split_dim: int | None = None
        self.expert_id: int | None = None
        self.stage_id: int | None = None


class TensorParallelism:
    def __init__(self) -> None:
        self.axes: list[ParallelAxis] = []


_READ_MODES = ("as_stored", "shard", "full")


class ReadTarget:
    """How a parallelism read returns a tensor: ``as_stored`` (the object's tensor),
    ``shard`` (this rank's shard per ``parallelism``), ``full`` (the whole tensor)."""

    def __init__(self) -> None:
        self._mode = "as_stored"
        self.parallelism: TensorParallelism | None = None

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, v: str) -> None:
        if v not in _READ_MODES:
            raise RuntimeError("Unsupported ReadTarget mode")
        self._mode = v


class QueryTaskResponse:
    def __init__(self) -> None:
        self.id = (0, 0)
        self.type = 0
        self.status = 0
        self.created_at_ms_epoch = 0
        self.last_updated_at_ms_epoch = 0
        self.assigned_client = ""
        self.message = ""
