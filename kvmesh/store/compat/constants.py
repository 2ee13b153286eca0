"""Mooncake's enums and status constants, with Mooncake's numeric values
(``mooncake-store/include/replica.h``, ``types.h`` in Mooncake's sources).

The enums are ``IntEnum`` like pybind11's (``int(SoftPinAction.ENABLE) == 1``); results of
store methods are never enum members but plain ``int`` (:func:`code`).
"""

from __future__ import annotations

from enum import IntEnum

from .. import errors as E

__all__ = [
    "NOT_SUPPORTED",
    "ObjectDataType",
    "ReplicaStatus",
    "SoftPinAction",
    "TaskStatus",
    "TaskType",
    "code",
]

NOT_SUPPORTED = -1012
"""Mooncake's ``ErrorCode::NOT_SUPPORTED``: what a method that cannot apply on kvmesh answers
(NVMe-oF, CXL, Mooncake's own transfer-engine object, its task queue)."""

INVALID_PARAMS = int(E.Code.INVALID_PARAMS)
OBJECT_NOT_FOUND = int(E.Code.OBJECT_NOT_FOUND)
BUFFER_OVERFLOW = int(E.Code.BUFFER_OVERFLOW)
OBJECT_EXISTS = int(E.Code.OBJECT_ALREADY_EXISTS)
FILE_NOT_FOUND = -1100  # Mooncake's ErrorCode::FILE_NOT_FOUND


def code(c: object) -> int:
    """A plain ``int`` for a code, whatever int subclass carried it (Mooncake returns ints:
    ``repr`` of a result must be ``-706``, not ``<Code.OBJECT_HAS_LEASE: -706>``)."""
    return int.__int__(c) if isinstance(c, int) else INVALID_PARAMS  # type: ignore[arg-type]


class SoftPinAction(IntEnum):
    """What a put or upsert does to the object's soft pin."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicaStatus(IntEnum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class ObjectDataType(IntEnum):
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class TaskType(IntEnum):
    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(IntEnum):
    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3
