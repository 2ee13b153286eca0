"""Same-process transport: the remote segment is memory of this very process; copy it.

Host to host uses the copy kernel of :mod:`kvmesh.transfer.fastcopy`; as soon as either side is
GPU memory the copy goes through CUDA (``cudaMemcpyAsync`` with unified addressing, via
:mod:`kvmesh.transfer.cuda`), when CUDA is usable in this process.
"""

from __future__ import annotations

from typing import Any

from ..errors import SegmentNotFound, TransportUnavailable
from ..fastcopy import copy_ranges
from ..memory import MemoryRegion
from ..types import MemoryKind, Op, SegmentDescriptor, TransportKind
from .base import CHUNK_BYTES, TransferJob, Transport, cut


def _cuda_usable() -> bool:
    try:
        from .. import cuda
    except ImportError:
        return False
    return cuda.available()


class LocalTransport(Transport):
    """Copies between two regions of this process (possibly registered by different engines)."""

    kind = TransportKind.LOCAL
    inline_ok = True
    cpu_copy = True

    def can_serve(self, local: MemoryRegion, remote: SegmentDescriptor) -> bool:
        if remote.pid != self.ctx.pid or remote.host_id != self.ctx.host_id:
            return False
        if local.is_host and remote.kind.is_host:
            return True
        return _cuda_usable()

    def open(self, remote: SegmentDescriptor) -> Any:
        region = self.ctx.find_region(remote.region_id)
        # pid equality alone could be a reused pid in another pid namespace: the region must be
        # the very one the descriptor names.
        if region is None or region.ptr != remote.base or region.size != remote.size:
            raise TransportUnavailable(f"segment {remote.name!r} is not memory of this process")
        return region

    def execute(self, job: TransferJob) -> None:
        region: MemoryRegion = job.route
        try:
            region.acquire()
        except Exception:
            raise SegmentNotFound(
                f"segment {job.remote.name!r} was unregistered by its owner"
            ) from None
        try:
            lo, ro, ln = job.coalesced()
            check = None
            if job.nbytes > CHUNK_BYTES:
                lo, ro, ln = cut(lo, ro, ln, CHUNK_BYTES)

                def check() -> None:
                    job.check()
                    if region.closed:  # unregister() is waiting for us: stop between chunks
                        raise SegmentNotFound(
                            f"segment {job.remote.name!r} was unregistered by its owner"
                        )

            if job.op is Op.WRITE:
                dst, dst_off, src, src_off = region.ptr, ro, job.local.ptr, lo
            else:
                dst, dst_off, src, src_off = job.local.ptr, lo, region.ptr, ro
            if job.local.is_host and region.is_host:
                copy_ranges(dst, dst_off, src, src_off, ln, check)
            else:
                from .. import cuda

                gpu = job.local if job.local.kind is MemoryKind.VRAM else region
                cuda.copy_runs(dst, dst_off, src, src_off, ln, gpu.device, check)
        finally:
            region.release()
