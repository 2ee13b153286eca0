"""Plain-TCP transport: the network path when NIXL is absent, or when forced by configuration.

Both directions are *pushes* (a pulled stream over TCP is 3x slower, nixl-notes §9): a WRITE
sends the pages after a ``WriteReq`` header and the owner receives them with ``recv_into``
straight into the segment; a READ sends a ``ReadReq`` and the owner pushes the pages, which
land with ``recv_into`` straight in local memory. Adjacent pages travel as one range.
"""

from __future__ import annotations

from typing import Any

from ..memory import MemoryRegion
from ..types import Op, SegmentDescriptor, TransportKind
from .base import Transport, TransferJob


class TcpTransport(Transport):
    """Pushes pages through the segment owner's control server."""

    kind = TransportKind.TCP

    def can_serve(self, local: MemoryRegion, remote: SegmentDescriptor) -> bool:
        return local.is_host and remote.kind.is_host

    def open(self, remote: SegmentDescriptor) -> Any:
        return self.ctx.peer(remote.control)

    def execute(self, job: TransferJob) -> None:
        job.check()
        lo, ro, ln = job.coalesced()
        mv = memoryview(job.local.array())
        views = [mv[o : o + n] for o, n in zip(lo.tolist(), ln.tolist())]
        if job.op is Op.WRITE:
            job.route.write(job.remote, ro, ln, views, job.nbytes, job.remaining())
        else:
            job.route.read(job.remote, ro, ln, views, job.nbytes, job.remaining())
