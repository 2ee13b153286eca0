"""Mooncake-Store-compatible surface: the names of Mooncake 0.3.13's ``mooncake.store``
(and 0.3.14's ``probe_key`` / ``batch_probe_key``) on kvmesh. Code written for Mooncake runs
by swapping the import::

    from kvmesh.store.compat import MooncakeDistributedStore, ReplicateConfig

One job per module: :mod:`.config` (``setup``'s arguments and Mooncake's size syntax),
:mod:`.constants` (enums, codes), :mod:`.types` (value classes), :mod:`.tensors` (Mooncake's
tensor object format), :mod:`.store` (the class: setup and lifecycle) with a mixin per method
group (:mod:`.put_methods`, :mod:`.get_methods`, :mod:`.query_methods`,
:mod:`.tensor_methods`, :mod:`.tensor_sharded`). What differs from Mooncake, method by
method: the compatibility table of docs/store.md.
"""

from __future__ import annotations

from .constants import (
    NOT_SUPPORTED,
    ObjectDataType,
    ReplicaStatus,
    SoftPinAction,
    TaskStatus,
    TaskType,
)
from .query_methods import literal_prefix
from .store import MooncakeDistributedStore, bind_to_numa_node
from .types import (
    BufferHandle,
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    ParallelAxis,
    QueryTaskResponse,
    ReadTarget,
    ReplicaDescriptor,
    ReplicateConfig,
    TensorParallelism,
)

__all__ = [
    "NOT_SUPPORTED",
    "BufferHandle",
    "Descriptor",
    "DiskDescriptor",
    "MemoryDescriptor",
    "MooncakeDistributedStore",
    "ObjectDataType",
    "ParallelAxis",
    "QueryTaskResponse",
    "ReadTarget",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "ReplicateConfig",
    "SoftPinAction",
    "TaskStatus",
    "TaskType",
    "TensorParallelism",
    "bind_to_numa_node",
    "literal_prefix",
    "module_names",
]


def module_names() -> dict[str, object]:
    """What ``mooncake.store`` exports, as kvmesh objects: the classes, the enums and, as
    Mooncake's ``export_values`` does, their members at module level (``COMPLETE``,
    ``KVCACHE``, ``REPLICA_COPY``, ``SUCCESS``...)."""
    names: dict[str, object] = {n: globals()[n] for n in __all__ if n != "module_names"}
    for enum in (ReplicaStatus, ObjectDataType, TaskType, TaskStatus):
        for m in enum:
            names.setdefault(m.name, m)
    return names
