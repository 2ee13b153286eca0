"""Transports: the ways bytes move. See ``base.py`` for the interface.

``REGISTRY`` lists every transport the engine knows, in selection order (docs/transfer.md,
"Transport selection"): a disk segment of this process first, then same process, then GPU
paths, then same-host shared memory, then NIXL, then plain TCP.
Entries are imported lazily so that a missing optional dependency (NIXL, CUDA) only disables
that transport.
"""

from __future__ import annotations

import importlib

from ..types import TransportKind
from .base import TransferJob, Transport, TransportContext, coalesce

# kind -> "module:Class", in preference order.
REGISTRY: dict[TransportKind, str] = {
    TransportKind.DISK: "kvmesh.transfer.transports.disk:DiskTransport",
    TransportKind.LOCAL: "kvmesh.transfer.transports.local:LocalTransport",
    TransportKind.NVLINK: "kvmesh.transfer.transports.cuda_ipc:NvlinkTransport",
    TransportKind.CUDA_IPC: "kvmesh.transfer.transports.cuda_ipc:CudaIpcTransport",
    TransportKind.SHM: "kvmesh.transfer.transports.shm:ShmTransport",
    TransportKind.NIXL: "kvmesh.transfer.transports.nixl:NixlTransport",
    TransportKind.TCP: "kvmesh.transfer.transports.tcp:TcpTransport",
}


def load(kind: TransportKind) -> tuple[type[Transport] | None, str | None]:
    """Import the transport class for ``kind``: ``(cls, None)`` or ``(None, why_not)``."""
    target = REGISTRY[kind]
    mod_name, _, cls_name = target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        return None, f"cannot import {mod_name}: {exc}"
    cls = getattr(mod, cls_name, None)
    if cls is None:
        return None, f"{mod_name} has no {cls_name}"
    try:
        reason = cls.unavailable_reason()
    except Exception as exc:  # a probe must never break engine start-up
        reason = f"probe failed: {exc!r}"
    return (None, reason) if reason else (cls, None)


__all__ = ["REGISTRY", "Transport", "TransportContext", "TransferJob", "coalesce", "load"]
