"""kvmesh.transfer: segments, registered memory, batched READ/WRITE, per-segment transports.

Knows local addresses, remote segments, offsets, lengths and transports; knows nothing about
keys or objects (that is kvmesh.store). See docs/transfer.md.
"""

from .batch import Batch, BatchResult
from .cuda import memory_kind
from .disk import DiskSegment
from .engine import TransferEngine, detect_host_id, get_engine, init_engine, shutdown_engine
from .errors import (
    AuthError,
    BatchStateError,
    Cancelled,
    ChecksumMismatch,
    DiskIOError,
    EngineClosed,
    InvalidArgument,
    InvalidLength,
    NotRegistered,
    OutOfBounds,
    PeerDeadError,
    ProtocolError,
    RequestTooLarge,
    SegmentExists,
    SegmentNotFound,
    TensorMismatch,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
)
from .memory import MemoryRegion, SharedBuffer
from .segment import RemoteSegment
from .types import (
    BatchState,
    EngineConfig,
    MemoryKind,
    Op,
    RequestStatus,
    SegmentDescriptor,
    TransportKind,
)

__all__ = [
    "AuthError",
    "Batch",
    "BatchResult",
    "BatchState",
    "BatchStateError",
    "Cancelled",
    "ChecksumMismatch",
    "DiskIOError",
    "DiskSegment",
    "EngineClosed",
    "EngineConfig",
    "InvalidArgument",
    "InvalidLength",
    "MemoryKind",
    "MemoryRegion",
    "NotRegistered",
    "Op",
    "OutOfBounds",
    "PeerDeadError",
    "ProtocolError",
    "RemoteSegment",
    "RequestStatus",
    "RequestTooLarge",
    "SegmentDescriptor",
    "SegmentExists",
    "SegmentNotFound",
    "SharedBuffer",
    "TensorMismatch",
    "TransferEngine",
    "TransferError",
    "TransferTimeout",
    "TransportKind",
    "TransportUnavailable",
    "detect_host_id",
    "get_engine",
    "init_engine",
    "memory_kind",
    "shutdown_engine",
]
