"""Transport selection: which transport serves (local memory kind, remote segment).

The engine's transports are kept in preference order (``transports.REGISTRY``: same process,
GPU paths, same-host shared memory, NIXL, TCP), already filtered by configuration. The first
one whose ``can_serve`` accepts and whose ``open`` succeeds wins; the opened route is cached
on the :class:`~kvmesh.transfer.segment.RemoteSegment` per local (kind, device), so the
choice and its set-up cost (mapping a file, loading NIXL metadata) happen once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .errors import TransportUnavailable
from .memory import MemoryRegion
from .segment import RemoteSegment, RouteHandle
from .transports.base import Transport

log = logging.getLogger("kvmesh.transfer")


def open_route(
    transports: Sequence[Transport],
    local: MemoryRegion,
    remote: RemoteSegment,
    *,
    host_id: str,
    unavailable: dict[str, str | None],
) -> RouteHandle:
    """Open a route through the first transport that accepts and opens.

    The engine passes this (bound to its transports) to ``RemoteSegment.route_for``, which
    caches the result per local (memory kind, device).
    """
    refused = []
    for t in transports:
        if not t.can_serve(local, remote.desc):
            continue
        try:
            opened = t.open(remote.desc)
        except TransportUnavailable as exc:
            refused.append(f"{t.kind.value}: {exc}")
            continue
        log.debug(
            "segment %s from %s memory: transport %s", remote.name, local.kind.value, t.kind.value
        )
        return RouteHandle(t, opened)
    off = {k: v for k, v in unavailable.items() if v}
    raise TransportUnavailable(
        f"no transport can move {local.kind.value} memory to/from segment {remote.name!r} "
        f"({remote.kind.value} on host {remote.desc.host_id}, we are {host_id}); "
        f"enabled: {[t.kind.value for t in transports]}"
        + (f"; refused: {refused}" if refused else "")
        + (f"; unavailable: {off}" if off else "")
    )
