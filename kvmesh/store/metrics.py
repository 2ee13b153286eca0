"""Prometheus metrics of a master replica (``prometheus_client``, optional).

:class:`MasterMetrics` counts requests and their latencies by type (updated by the service on
every request) and, at scrape time, reads the rest from the service: raft role, term, commit
and applied index, pool capacity and usage, objects, live leases, evictions, hits and misses.
``kvmesh master --metrics-port N`` serves them on ``127.0.0.1:N/metrics``. Without
``prometheus_client`` installed, metrics are off and everything else works.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["MasterMetrics", "available"]

try:  # optional dependency
    from prometheus_client import (
        CollectorRegistry,
        Counter,
        Histogram,
        start_http_server,
    )
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    _HAVE = True
except ImportError:  # pragma: no cover - exercised only without the package
    _HAVE = False


def available() -> bool:
    return _HAVE


class _StateCollector:
    """Scrape-time view of the service (no bookkeeping on the hot path)."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def describe(self) -> list:
        return []

    def collect(self) -> Any:
        svc = self.service
        # A copy the service refreshes on its own loop: the HTTP thread never walks live
        # tables that the event loop is changing.
        st = svc.status_cache
        usage = st.get("usage") or {}
        g = GaugeMetricFamily
        yield g("kvmesh_store_raft_term", "raft term of this replica", value=st.get("term", 0) or 0)
        yield g(
            "kvmesh_store_raft_commit_index", "raft commit index", value=st.get("commit", 0) or 0
        )
        yield g(
            "kvmesh_store_raft_applied_index", "raft applied index", value=st.get("applied", 0) or 0
        )
        yield g(
            "kvmesh_store_is_leader",
            "1 if this replica leads",
            value=1 if st.get("role") == "LEADER" else 0,
        )
        media = st.get("media") or {"memory": usage}
        cap = g("kvmesh_store_capacity_bytes", "bytes of mounted segments", labels=["medium"])
        used = g("kvmesh_store_used_bytes", "allocated bytes", labels=["medium"])
        for m, u in media.items():
            cap.add_metric([m], u.get("capacity", 0))
            used.add_metric([m], u.get("used", 0))
        yield cap
        yield used
        yield g(
            "kvmesh_store_held_bytes",
            "bytes held for leases by forced removes",
            value=usage.get("held_bytes", 0),
        )
        yield g("kvmesh_store_objects", "objects (PROCESSING included)", value=st.get("objects", 0))
        yield g("kvmesh_store_segments", "mounted segments", value=len(st.get("segments", [])))
        yield g("kvmesh_store_leases", "live read leases (leader)", value=st.get("leases", 0))
        c = CounterMetricFamily
        yield c(
            "kvmesh_store_evicted_objects",
            "objects evicted by this replica as leader",
            value=svc.counters.get("evicted", 0),
        )
        yield c(
            "kvmesh_store_demote_failed",
            "demotions their node reported failed (revoked, retried after the disk's backoff)",
            value=svc.counters.get("demote_failed", 0),
        )
        yield c("kvmesh_store_read_hits", "keys found by GetReplicas", value=svc.hits)
        yield c("kvmesh_store_read_misses", "keys not found by GetReplicas", value=svc.misses)


class MasterMetrics:
    """Request counters/latencies plus the scrape-time collector, in a private registry."""

    def __init__(self, service: Any) -> None:
        if not _HAVE:
            raise RuntimeError("prometheus_client is not installed")
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvmesh_store_requests",
            "requests by type and outcome",
            ["type", "outcome"],
            registry=self.registry,
        )
        self.keys = Counter(
            "kvmesh_store_request_keys", "keys named by requests", ["type"], registry=self.registry
        )
        self.latency = Histogram(
            "kvmesh_store_request_seconds",
            "request latency by type",
            ["type"],
            registry=self.registry,
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1, 5),
        )
        self.registry.register(_StateCollector(service))
        self._server: Any = None
        # (type, outcome) -> its child metrics: a .labels() lookup costs several us per
        # request (label validation, a lock, a dict); the children never change. Request
        # types and outcomes are a fixed handful, so this stays small.
        self._children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}

    def observe(self, kind: str, outcome: str, nkeys: int, started: float) -> None:
        ch = self._children.get((kind, outcome))
        if ch is None:
            ch = self._children[(kind, outcome)] = (
                self.requests.labels(kind, outcome),
                self.keys.labels(kind),
                self.latency.labels(kind),
            )
        ch[0].inc()
        if nkeys:
            ch[1].inc(nkeys)
        ch[2].observe(time.perf_counter() - started)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        self._server = start_http_server(port, addr=addr, registry=self.registry)
