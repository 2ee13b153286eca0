"""Segments: the local table of published regions, and handles on remote segments.

A segment is a registered region published under a name. The owner keeps a
:class:`SegmentTable`; a peer holds a :class:`RemoteSegment` per segment it opened, which
caches the descriptor and, per kind of local memory, the transport route chosen for it
(an open route is a mapping, a connection pool or loaded NIXL metadata: opened once, used by
many batches, closed when the segment goes away and no job uses it any more).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import SegmentExists, SegmentNotFound
from .types import MemoryKind, SegmentDescriptor

if TYPE_CHECKING:  # pragma: no cover
    from .control import PeerClient
    from .memory import MemoryRegion
    from .transports.base import PeerLiveness, Transport


class SegmentTable:
    """Published segments of one engine, by name. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, tuple[SegmentDescriptor, MemoryRegion]] = {}

    def add(self, desc: SegmentDescriptor, region: MemoryRegion) -> None:
        with self._lock:
            if desc.name in self._by_name:
                raise SegmentExists(f"segment {desc.name!r} is already published by this engine")
            self._by_name[desc.name] = (desc, region)

    def remove(self, name: str) -> tuple[SegmentDescriptor, MemoryRegion]:
        with self._lock:
            try:
                return self._by_name.pop(name)
            except KeyError:
                raise SegmentNotFound(f"no segment named {name!r} is published here") from None

    def lookup(self, name: str) -> tuple[SegmentDescriptor, MemoryRegion]:
        try:
            return self._by_name[name]
        except KeyError:
            raise SegmentNotFound(f"no segment named {name!r} is published here") from None

    def list(self) -> list[SegmentDescriptor]:
        with self._lock:
            return [d for d, _ in self._by_name.values()]

    def names_of(self, region: MemoryRegion) -> list[str]:
        with self._lock:
            return [n for n, (_, r) in self._by_name.items() if r is region]


class RouteHandle:
    """An opened transport route to one segment, reference-counted by the jobs using it."""

    __slots__ = ("transport", "route", "_users", "_closing", "_lock")

    def __init__(self, transport: Transport, route: Any) -> None:
        self.transport = transport
        self.route = route
        self._users = 0
        self._closing = False
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        with self._lock:
            if self._closing:
                return False
            self._users += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._closing and self._users == 0
        if last:
            self.transport.close_route(self.route)

    def close(self) -> None:
        """Close now if idle, else when the last job releases it."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            idle = self._users == 0
        if idle:
            self.transport.close_route(self.route)


class RemoteSegment:
    """A handle on a segment published by a peer (or by this engine).

    Obtained from ``TransferEngine.open_segment``; pass it to batch requests. It becomes stale
    when the owner removes or replaces the segment, or dies; requests on it then raise
    ``SegmentNotFound`` or ``PeerDeadError``.
    """

    __slots__ = ("desc", "peer", "_routes", "_lock", "stale_reason", "__weakref__")

    def __init__(self, desc: SegmentDescriptor, peer: PeerClient) -> None:
        self.desc = desc
        self.peer = peer
        self._routes: dict[tuple[MemoryKind, int], RouteHandle] = {}
        self._lock = threading.Lock()
        self.stale_reason: str | None = None

    @property
    def name(self) -> str:
        return self.desc.name

    @property
    def size(self) -> int:
        return self.desc.size

    @property
    def kind(self) -> MemoryKind:
        return self.desc.kind

    @property
    def liveness(self) -> PeerLiveness:
        return self.peer.liveness

    def transports(self) -> dict[str, str]:
        """The transport chosen so far per local memory kind (e.g. ``{"dram": "shm"}``)."""
        with self._lock:
            return {
                (k.value if d < 0 else f"{k.value}:{d}"): h.transport.kind.value
                for (k, d), h in self._routes.items()
            }

    def route_for(
        self, local: MemoryRegion, open_route: Callable[[MemoryRegion, RemoteSegment], RouteHandle]
    ) -> RouteHandle:
        """The route cached for ``local``'s (memory kind, device), else ``open_route``'s.

        ``open_route`` runs under this segment's lock, so concurrent first users open one
        route, not one each; its error (``TransportUnavailable``) propagates and caches nothing.
        """
        key = (local.kind, local.device)
        h = self._routes.get(key)
        if h is not None:
            return h
        with self._lock:
            h = self._routes.get(key)
            if h is None:
                h = self._routes[key] = open_route(local, self)
            return h

    def gone_error(self) -> Exception:
        """The error for a request on this segment once its route was closed under it."""
        from .errors import PeerDeadError

        reason = self.peer.liveness.dead_reason
        if reason is not None:
            return PeerDeadError(
                f"owner of segment {self.name!r} ({self.peer.address}) is dead: {reason}"
            )
        return SegmentNotFound(
            f"segment {self.name!r} is gone: {self.stale_reason or 'closed while submitting'}"
        )

    def close_routes(self) -> None:
        """Close the cached transport routes (the engine does, when the segment goes)."""
        with self._lock:
            routes, self._routes = list(self._routes.values()), {}
        for h in routes:
            h.close()

    def __repr__(self) -> str:
        state = f", stale: {self.stale_reason}" if self.stale_reason else ""
        return (
            f"RemoteSegment({self.desc.name!r} of {self.desc.node_id} at {self.desc.control}, "
            f"{self.desc.size} bytes {self.desc.kind.value}{state})"
        )
