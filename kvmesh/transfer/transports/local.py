"""Same-process transport: the remote segment is memory of this very process; memmove it."""

from __future__ import annotations

from typing import Any

from ..errors import SegmentNotFound, TransportUnavailable
from ..fastcopy import copy_ranges
from ..memory import MemoryRegion
from ..types import Op, SegmentDescriptor, TransportKind
from .base import Transport, TransferJob


class LocalTransport(Transport):
    """memmove between two regions of this process (possibly registered by different engines)."""

    kind = TransportKind.LOCAL
    inline_ok = True

    def can_serve(self, local: MemoryRegion, remote: SegmentDescriptor) -> bool:
        return (
            local.is_host
            and remote.kind.is_host
            and remote.pid == self.ctx.pid
            and remote.host_id == self.ctx.host_id
        )

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
            raise SegmentNotFound(f"segment {job.remote.name!r} was unregistered by its owner") from None
        try:
            lo, ro, ln = job.coalesced()
            check = job.check if job.nbytes > (8 << 20) else None
            if job.op is Op.WRITE:
                copy_ranges(region.ptr, ro, job.local.ptr, lo, ln, check)
            else:
                copy_ranges(job.local.ptr, lo, region.ptr, ro, ln, check)
        finally:
            region.release()
