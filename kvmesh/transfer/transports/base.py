"""The Transport interface: how a way of moving bytes plugs into the engine.

The engine owns everything around a transport: registration, segment publishing, batches,
bounds checks, deadlines, peer liveness, threads and completion. A transport only answers
"can you reach this segment from that local memory?" and moves one :class:`TransferJob`.

Lifecycle, as the engine drives it::

    t = SomeTransport(ctx)            # once per engine, if unavailable_reason() is None
    t.on_register(region)             # every local registration (NIXL registers with its agent)
    fields = t.describe(region)       # when a region is published: descriptor fields to add
    t.can_serve(local, desc)          # selection, cached per (local kind/device, segment)
    route = t.open(desc)              # once per remote segment: connect / map / load metadata
    t.execute(job)                    # many times, from worker threads or the submitting thread
    t.close_route(route)              # segment removed, peer dead, engine closing
    t.peer_lost(engine_id)            # the peer's control connection dropped
    t.on_unregister(region)
    t.close()

Rules for implementations:

* ``execute`` is blocking and may run in several threads at once (also for the same route).
  It raises a :class:`~kvmesh.transfer.errors.TransferError` subclass on failure
  (``PeerDeadError`` for a vanished peer, ``TransferTimeout`` past ``job.deadline``); it
  returns normally only when every byte of the job has landed. Bounds were already checked
  against both regions before the job was created.
* Long copies call ``job.check()`` now and then (between chunks, while polling), so a dead
  peer, a cancelled batch or an expired deadline ends the job within bounded time.
* Nothing on a per-page path allocates per page: use the job's numpy arrays as they are
  (``job.coalesced()`` merges adjacent pages into runs first, which helps every transport).
* A transport that needs its own request/response exchange with the owner of a segment uses
  ``ctx.call(desc.control, payload)``; the owner's engine hands ``payload`` to the
  ``handle_call`` of its transport of the same kind and returns the reply bytes.
"""

from __future__ import annotations

import abc
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..errors import Cancelled, PeerDeadError, TransferTimeout
from ..types import EngineConfig, Op, SegmentDescriptor, TransportKind

if TYPE_CHECKING:  # pragma: no cover
    from ..memory import MemoryRegion


class TransportContext:
    """What the engine shares with its transports."""

    __slots__ = ("engine_id", "node_id", "host_id", "pid", "config", "call", "find_region", "peer")

    def __init__(
        self,
        *,
        engine_id: str,
        node_id: str,
        host_id: str,
        pid: int,
        config: EngineConfig,
        call: Callable[[str, TransportKind, bytes, float | None], bytes],
        find_region: Callable[[int], MemoryRegion | None],
        peer: Callable[[str], Any],
    ) -> None:
        self.engine_id = engine_id
        self.node_id = node_id
        self.host_id = host_id
        self.pid = pid
        self.config = config
        # call(control_address, kind, payload, timeout) -> reply: a transport-private RPC to the
        # peer engine's transport of the same kind (see Transport.handle_call).
        self.call = call
        # find_region(region_id) -> a live region of *this process* (any engine) or None.
        self.find_region = find_region
        # peer(control_address) -> the engine's connected PeerClient (control.py) for that peer:
        # pooled authenticated connections, .liveness, .ping(), .call().
        self.peer = peer


class PeerLiveness:
    """Liveness of one peer engine as seen from here (set by the engine's monitor thread)."""

    __slots__ = ("engine_id", "address", "dead_reason")

    def __init__(self, engine_id: str, address: str) -> None:
        self.engine_id = engine_id
        self.address = address
        self.dead_reason: str | None = None

    @property
    def alive(self) -> bool:
        return self.dead_reason is None


class TransferJob:
    """A run of requests of one batch that share op, local region and remote segment.

    Offsets and lengths are ``uint64`` numpy arrays of equal length; ``nbytes`` is their sum.
    """

    __slots__ = (
        "op",
        "local",
        "remote",
        "route",
        "local_offsets",
        "remote_offsets",
        "lengths",
        "nbytes",
        "deadline",
        "peer",
        "cancelled",
        "_coalesced",
    )

    def __init__(
        self,
        op: Op,
        local: MemoryRegion,
        remote: SegmentDescriptor,
        route: Any,
        local_offsets: np.ndarray,
        remote_offsets: np.ndarray,
        lengths: np.ndarray,
        nbytes: int,
        deadline: float,
        peer: PeerLiveness | None,
        *,
        coalesced: bool = False,
    ) -> None:
        # coalesced: the caller merged adjacent requests already (no second pass per job).
        self.op = op
        self.local = local
        self.remote = remote
        self.route = route
        self.local_offsets = local_offsets
        self.remote_offsets = remote_offsets
        self.lengths = lengths
        self.nbytes = nbytes
        self.deadline = deadline
        self.peer = peer
        self.cancelled = False
        self._coalesced: tuple[np.ndarray, np.ndarray, np.ndarray] | None = (
            (local_offsets, remote_offsets, lengths) if coalesced else None
        )

    def __len__(self) -> int:
        return len(self.lengths)

    def check(self) -> None:
        """Raise if the job must stop: cancelled batch, dead peer or expired deadline."""
        if self.cancelled:
            raise Cancelled("the batch was cancelled or freed while this request was in flight")
        peer = self.peer
        if peer is not None and peer.dead_reason is not None:
            raise PeerDeadError(
                f"peer {peer.address} (segment {self.remote.name!r}) is dead: {peer.dead_reason}"
            )
        if time.monotonic() > self.deadline:
            raise TransferTimeout(
                f"{self.op.value} of {self.nbytes} bytes on segment {self.remote.name!r} "
                f"passed its deadline"
            )

    def remaining(self) -> float:
        """Seconds left before the deadline; raises ``TransferTimeout`` when none are left."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.check()
            raise TransferTimeout(f"transfer on segment {self.remote.name!r} passed its deadline")
        return left

    def coalesced(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(local_offsets, remote_offsets, lengths) with adjacent requests merged into runs.

        Two consecutive requests merge when both their local and remote ranges are
        contiguous. Computed once per job with vectorised numpy.
        """
        if self._coalesced is None:
            self._coalesced = coalesce(self.local_offsets, self.remote_offsets, self.lengths)
        return self._coalesced


CHUNK_BYTES = 8 << 20  # most bytes a long copy moves between two job checks


def cut(
    local_offsets: np.ndarray, remote_offsets: np.ndarray, lengths: np.ndarray, most: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same ranges with every one longer than ``most`` cut at multiples of ``most``."""
    if len(lengths) == 0 or int(lengths.max()) <= most:
        return local_offsets, remote_offsets, lengths
    m = np.uint64(most)
    pieces = (lengths + (m - np.uint64(1))) // m
    src = np.repeat(np.arange(len(lengths)), pieces.astype(np.int64))
    first = np.repeat(np.cumsum(pieces) - pieces, pieces.astype(np.int64))
    skip = (np.arange(len(src), dtype=np.uint64) - first) * m
    return (
        local_offsets[src] + skip,
        remote_offsets[src] + skip,
        np.minimum(lengths[src] - skip, m),
    )


def chunks(
    local_offsets: np.ndarray, remote_offsets: np.ndarray, lengths: np.ndarray, most: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Consecutive runs of the (cut) ranges, each moving less than ``2 * most`` bytes."""
    lo, ro, ln = cut(local_offsets, remote_offsets, lengths, most)
    bucket = (np.cumsum(ln) - ln) // np.uint64(most)
    edges = np.flatnonzero(bucket[1:] != bucket[:-1]) + 1
    bounds = [0, *edges.tolist(), len(ln)]
    return [(lo[a:b], ro[a:b], ln[a:b]) for a, b in itertools.pairwise(bounds)]


def coalesce(
    local_offsets: np.ndarray, remote_offsets: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive requests whose local and remote ranges are both contiguous."""
    n = len(lengths)
    if n < 2:
        return local_offsets, remote_offsets, lengths
    ends_l = local_offsets[:-1] + lengths[:-1]
    ends_r = remote_offsets[:-1] + lengths[:-1]
    cont = (ends_l == local_offsets[1:]) & (ends_r == remote_offsets[1:])
    if not cont.any():
        return local_offsets, remote_offsets, lengths
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    sums = np.add.reduceat(lengths, starts)
    return local_offsets[starts], remote_offsets[starts], sums.astype(np.uint64, copy=False)


class Transport(abc.ABC):
    """One way of moving bytes. Subclasses set ``kind`` and implement ``can_serve``/``execute``."""

    kind: ClassVar[TransportKind]
    # True when execute() is a pure CPU copy with nothing to wait for: small jobs then run in the
    # submitting thread (no thread hand-off: a 4 KiB same-host transfer stays in the µs range).
    inline_ok: ClassVar[bool] = False
    # True when execute_writes() carries many WRITE jobs to one peer back to back from the
    # calling thread (one connection, acks read behind): cheaper than a hand-off per job.
    pipelined_writes: ClassVar[bool] = False
    # False when cutting a big job into parts for several worker threads does not pay (one
    # NIXL agent posts them one after the other and each extra handle costs 7-25 %).
    split_ok: ClassVar[bool] = True
    # True when execute() copies with the CPU in this thread through fastcopy (GIL released per
    # range): such bulk jobs run under fastcopy.bulk_slot, at most one per CPU at a time.
    cpu_copy: ClassVar[bool] = False

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """``None`` when this transport can run in this process, else a short reason."""
        return None

    # --- local memory -------------------------------------------------------------------
    def on_register(self, region: MemoryRegion) -> None:
        """A local region was registered (called before it can be used or published)."""

    def on_unregister(self, region: MemoryRegion) -> None:
        """A local region is going away (no job uses it any more)."""

    def describe(self, region: MemoryRegion) -> dict[str, Any]:
        """Descriptor fields this transport needs peers to know about a published region."""
        return {}

    # --- remote segments ----------------------------------------------------------------
    @abc.abstractmethod
    def can_serve(self, local: MemoryRegion, remote: SegmentDescriptor) -> bool:
        """Whether this transport can move bytes between ``local`` and ``remote``. Cheap."""

    def open(self, remote: SegmentDescriptor) -> Any:
        """Prepare to reach ``remote`` (map, connect, load metadata). Result is ``job.route``.

        Raise ``TransportUnavailable`` if it turns out the segment cannot be reached this way
        (the engine then tries the next transport).
        """
        return None

    def close_route(self, route: Any) -> None:
        """Release what ``open`` built (no job uses the route any more)."""

    @abc.abstractmethod
    def execute(self, job: TransferJob) -> None:
        """Move every byte of ``job``; blocking; raise a ``TransferError`` on failure."""

    def handle_call(self, payload: bytes) -> bytes:
        """Answer a transport-private request from a peer (see ``TransportContext.call``)."""
        raise NotImplementedError(f"transport {self.kind.value} takes no peer calls")

    # --- lifecycle ----------------------------------------------------------------------
    def peer_lost(self, engine_id: str) -> None:
        """The peer engine ``engine_id`` died or closed: drop what is cached for it."""

    def close(self) -> None:
        """Stop threads and release everything; called once when the engine closes."""
