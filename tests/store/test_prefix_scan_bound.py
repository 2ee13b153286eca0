"""Remove-by-prefix scans run one at a time on a master.

Each scan holds a copy of the whole key list while it yields between slices, so without a
bound, concurrent requests (max_connections x max_inflight of them) would hold that many
copies at once. The test counts scans in progress on a live embedded master, and shows the
count is not 1 when the bound is taken away (the negative control)."""

from __future__ import annotations

import contextlib
import threading

from kvmesh.store import StoreClient
from kvmesh.store.embedded_master import EmbeddedMaster


def _drive(monkeypatch, *, unbounded: bool) -> int:
    m = EmbeddedMaster()
    svc = m.service
    assert svc is not None
    active = [0]
    peak = [0]
    real_key_list = svc.sm.key_list
    real_plan = svc.leader.plan_remove_prefix

    def key_list():
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        # 40k keys that match no prefix: the scan yields ~10 times between slices
        return real_key_list() + [f"zz-{i}" for i in range(40_000)]

    def plan(*a, **kw):
        active[0] -= 1
        return real_plan(*a, **kw)

    monkeypatch.setattr(svc.sm, "key_list", key_list)
    monkeypatch.setattr(svc.leader, "plan_remove_prefix", plan)
    if unbounded:

        class _NoLock:
            async def __aenter__(self):
                return None

            async def __aexit__(self, *exc):
                return None

        svc._scan_lock = _NoLock()
    clients = [StoreClient(m.address, token=m.security.token, timeout=30) for _ in range(6)]
    errors: list[BaseException] = []
    start = threading.Barrier(len(clients))

    def run(c: StoreClient, i: int) -> None:
        try:
            start.wait()
            for _ in range(3):
                c.remove_prefix(f"p{i}/")
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    try:
        ths = [threading.Thread(target=run, args=(c, i)) for i, c in enumerate(clients)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(60)
        assert not errors, errors
        assert active[0] == 0
        return peak[0]
    finally:
        for c in clients:
            with contextlib.suppress(Exception):
                c.close()
        m.stop()


def test_prefix_scans_never_overlap(monkeypatch):
    assert _drive(monkeypatch, unbounded=False) == 1


def test_planted_unbounded_scans_overlap(monkeypatch):
    peak = _drive(monkeypatch, unbounded=True)
    assert peak > 1  # six clients' scans overlap when nothing serializes them
