"""CUDA IPC transport: GPU memory of another process on this host, copied by the GPU.

The owner exports a ``cudaIpcMemHandle_t`` for the allocation holding each published VRAM
segment (``describe``: ``cuda_ipc`` + ``cuda_ipc_offset`` in the descriptor, and the device
UUID in ``extra["cuda_uuid"]`` because ordinals differ between processes). A peer maps the
allocation once per process (``open``) and moves pages with ``cudaMemcpyAsync`` on its own
stream, synchronised once per job. The local side may be GPU or host memory.

Two transports share this code so that every batch reports what really carried it:

* :class:`NvlinkTransport` (``nvlink``): local GPU memory on another device that can access
  the owner's device directly (``cudaDeviceCanAccessPeer``: NVLink or PCIe P2P);
* :class:`CudaIpcTransport` (``cuda_ipc``): everything else CUDA IPC can do (same device,
  host memory on our side, or devices without peer access, where the copy is staged by CUDA).

Allocations from the CUDA virtual memory API cannot be exported this way; their segments carry
no handle and are served by NIXL.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import cuda
from ..errors import TransportUnavailable
from ..memory import MemoryRegion
from ..types import MemoryKind, Op, SegmentDescriptor, TransportKind
from .base import TransferJob, Transport

log = logging.getLogger("kvmesh.transfer")

_UUID_KEY = "cuda_uuid"


class _IpcRoute:
    __slots__ = ("handle", "ptr", "device", "name")

    def __init__(self, handle: bytes, ptr: int, device: int, name: str) -> None:
        self.handle = handle
        self.ptr = ptr  # the segment's first byte, mapped into this process
        self.device = device  # our ordinal of the owner's device
        self.name = name


class CudaIpcTransport(Transport):
    """Same-host GPU segments through CUDA IPC handles and ``cudaMemcpyAsync``."""

    kind = TransportKind.CUDA_IPC
    inline_ok = True  # the copy is synchronous in the calling thread anyway

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return cuda.unavailable_reason()

    # --- owner side --------------------------------------------------------------------------
    def describe(self, region: MemoryRegion) -> dict[str, Any]:
        if region.kind is not MemoryKind.VRAM:
            return {}
        got = region.transport_data.get("cuda_ipc")
        if got is None:
            try:
                handle, offset = cuda.export_ipc(region.ptr, region.device)
                got = {
                    "cuda_ipc": handle,
                    "cuda_ipc_offset": offset,
                    "extra": {_UUID_KEY: cuda.device_uuid(region.device)},
                }
            except cuda.CudaError as exc:
                log.info("no CUDA IPC handle for %r (peers will use NIXL): %s", region, exc)
                got = {}
            region.transport_data["cuda_ipc"] = got
        return dict(got)

    def on_unregister(self, region: MemoryRegion) -> None:
        region.transport_data.pop("cuda_ipc", None)

    # --- peer side ---------------------------------------------------------------------------
    def _remote_ordinal(self, remote: SegmentDescriptor) -> int | None:
        uuid = remote.extra.get(_UUID_KEY)
        return cuda.ordinal_of(uuid) if uuid else None

    def _ipc_ok(self, local: MemoryRegion, remote: SegmentDescriptor) -> int | None:
        """Our ordinal of the owner's device when CUDA IPC can reach ``remote``, else None."""
        if (
            remote.kind is not MemoryKind.VRAM
            or remote.cuda_ipc is None
            or remote.host_id != self.ctx.host_id
            or remote.pid == self.ctx.pid  # CUDA refuses to open our own handles
        ):
            return None
        if local.kind is MemoryKind.VRAM and not 0 <= local.device < cuda.device_count():
            return None
        return self._remote_ordinal(remote)

    def can_serve(self, local: MemoryRegion, remote: SegmentDescriptor) -> bool:
        return self._ipc_ok(local, remote) is not None

    def open(self, remote: SegmentDescriptor) -> Any:
        device = self._remote_ordinal(remote)
        if device is None or remote.cuda_ipc is None:
            raise TransportUnavailable(f"the GPU of segment {remote.name!r} is not visible here")
        try:
            base = cuda.open_ipc(remote.cuda_ipc, device)
        except cuda.CudaError as exc:
            raise TransportUnavailable(f"cannot map segment {remote.name!r}: {exc}") from None
        return _IpcRoute(bytes(remote.cuda_ipc), base + remote.cuda_ipc_offset, device, remote.name)

    def close_route(self, route: Any) -> None:
        cuda.close_ipc(route.handle)

    def execute(self, job: TransferJob) -> None:
        route: _IpcRoute = job.route
        local = job.local
        device = local.device if local.kind is MemoryKind.VRAM else route.device
        lo, ro, ln = job.coalesced()
        check = job.check if len(ln) > 256 else None
        if job.op is Op.WRITE:
            cuda.copy_runs(route.ptr, ro, local.ptr, lo, ln, device, check)
        else:
            cuda.copy_runs(local.ptr, lo, route.ptr, ro, ln, device, check)

    def close(self) -> None:
        pass


class NvlinkTransport(CudaIpcTransport):
    """CUDA IPC between two GPUs with direct peer access (NVLink or PCIe P2P)."""

    kind = TransportKind.NVLINK

    def can_serve(self, local: MemoryRegion, remote: SegmentDescriptor) -> bool:
        if local.kind is not MemoryKind.VRAM:
            return False
        device = self._ipc_ok(local, remote)
        return device is not None and cuda.can_access_peer(local.device, device)
