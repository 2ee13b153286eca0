"""A NIXL transfer that fails because its peer died reports the death, not the lookup failure.

When the monitor sees a peer die, NIXL forgets that peer's agent; a transfer already past its
checks then fails with NIXL_ERR_NOT_FOUND (``NotRegistered``), which reads as "memory not
registered" (the SGLang PD drop-in turned it into the wrong return code). Deterministic: the
agent is a stand-in that fails the way NIXL does.
"""

from __future__ import annotations

import time
import types

import numpy as np
import pytest

from kvmesh.transfer import NotRegistered, Op, PeerDeadError
from kvmesh.transfer.transports.base import PeerLiveness, TransferJob
from kvmesh.transfer.transports.nixl import NixlTransport


class _Agent:
    def make_xfer(self, *args, **kw):
        raise NotRegistered("NIXL WRITE: unknown peer agent (NIXL_ERR_NOT_FOUND)")


@pytest.mark.parametrize("dead", [True, False])
def test_not_found_from_a_dead_peer_is_peer_dead(monkeypatch, dead):
    t = object.__new__(NixlTransport)
    monkeypatch.setattr(NixlTransport, "agent", property(lambda self: _Agent()))
    monkeypatch.setattr(NixlTransport, "_nixl_region", lambda self, region: object())
    live = PeerLiveness("peer-engine", "127.0.0.1:1")
    if dead:
        live.dead_reason = "watch connection closed"
    one = np.zeros(1, np.uint64)
    route = types.SimpleNamespace(read_mode="nixl", peer="p", remote="r", fence=None)
    job = TransferJob(
        Op.WRITE,
        object(),
        types.SimpleNamespace(name="seg"),
        route,
        one,
        one,
        one + 4096,
        4096,
        time.monotonic() + 30,
        live,
    )
    with pytest.raises(PeerDeadError if dead else NotRegistered):
        t.execute(job)
