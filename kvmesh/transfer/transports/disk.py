"""Disk transport: a disk segment of this very process; ``preadv``/``pwritev`` into local memory.

The file I/O, its ``O_DIRECT`` alignment rules and its staging buffers live in
``kvmesh/transfer/disk.py``; this is the Transport face of it. Disk segments of other
processes are reached through their owner's TCP path (``transports/tcp.py`` hands those
requests to the segment), never by opening a file a descriptor names.
"""

from __future__ import annotations

from typing import Any

from ..disk import DiskSegment, find_live
from ..errors import NotRegistered, SegmentNotFound, TransportUnavailable
from ..memory import MemoryRegion
from ..types import MemoryKind, Op, SegmentDescriptor, TransportKind
from .base import TransferJob, Transport


class DiskTransport(Transport):
    """Reads and writes this process's disk segments by offset."""

    kind = TransportKind.DISK

    def can_serve(self, local: MemoryRegion, remote: SegmentDescriptor) -> bool:
        return (
            remote.kind is MemoryKind.DISK
            and local.is_host
            and remote.pid == self.ctx.pid
            and remote.host_id == self.ctx.host_id
        )

    def open(self, remote: SegmentDescriptor) -> Any:
        seg = find_live(remote.region_id)
        # The pid alone could be a reused one in another pid namespace: the segment must be
        # the very one the descriptor names.
        if seg is None or seg.seg_id != remote.seg_id or seg.size != remote.size:
            raise TransportUnavailable(f"segment {remote.name!r} is not a disk segment here")
        return seg

    def execute(self, job: TransferJob) -> None:
        seg: DiskSegment = job.route
        try:
            seg.acquire()
        except NotRegistered:
            raise SegmentNotFound(
                f"segment {job.remote.name!r} was unregistered by its owner"
            ) from None
        try:
            lo, ro, ln = job.coalesced()

            def check() -> None:
                job.check()
                if seg.closed:  # unregister() is waiting for us: stop between chunks
                    raise SegmentNotFound(
                        f"segment {job.remote.name!r} was unregistered by its owner"
                    )

            seg.io(job.op, job.local.array(), lo, ro, ln, check)
            if job.op is Op.WRITE and seg.durable:
                seg.sync()
        finally:
            seg.release()
