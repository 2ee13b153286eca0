"""A pre-authentication flood against a LIVE engine's control server (issue 16, part 3).

An attacker without the token holds more silent connections than the server lets wait in
their handshake and reopens each one the server closes. Before the fix the control server
refused every newcomer while the slots were full: a real peer got in 1-4 times of 40.
"""

from __future__ import annotations

import numpy as np

from kvmesh.transfer import EngineConfig, Op, TransferEngine, TransferError
from kvmesh.transfer import protocol as P

from ..net.flood import SilentFlood
from .test_hostile import threads
from .util import Peer, pattern, sha

MiB = 1 << 20


def _attempt(peer: Peer, seed: int) -> bool:
    """A fresh engine (new connections, new handshakes) writes and reads back 4 pages."""
    eng = TransferEngine(
        config=EngineConfig(transport="tcp", host_id="flood-client", token="right")
    )
    try:
        seg = eng.open_segment(peer.address, "pool")
        src = pattern(seed, 0, 4 * 4096)
        local = eng.register(src.copy())
        eng.transfer(Op.WRITE, local, np.arange(4) * 4096, seg, np.arange(4) * 4096, 4096)
        back = eng.register(np.zeros(4 * 4096, np.uint8))
        eng.transfer(Op.READ, back, np.arange(4) * 4096, seg, np.arange(4) * 4096, 4096)
        return sha(back.array()) == sha(src)
    except TransferError:
        return False
    finally:
        eng.close()


def test_silent_connections_without_the_token_do_not_lock_peers_out():
    with Peer("--size", str(4 * MiB), "--token", "right") as peer:
        host, port = P.split_host_port(peer.address)
        cap = EngineConfig().max_unauthenticated
        # Same source address as the honest peer: per-source limits do not tell them apart,
        # eviction of the oldest stalled handshake must.
        with SilentFlood(host, port, n=cap + 36, max_s=120) as flood:
            ok = sum(_attempt(peer, seed) for seed in range(40))
            held = len(flood._sel.get_map())
        assert flood.opened >= cap, flood.opened  # the flood did fill the handshake slots
        assert held >= cap // 2, held
        assert ok >= 38, f"an honest peer got in {ok} times of 40"


def test_a_flood_from_another_address_holds_at_most_its_per_source_share():
    """200 silent connections from 127.0.0.2 hold at most the per-source cap of handshake
    threads; an honest peer on 127.0.0.1 always gets in."""
    with Peer("--size", str(4 * MiB), "--token", "right") as peer:
        host, port = P.split_host_port(peer.address)
        per_source = EngineConfig().max_unauthenticated_per_source
        th0 = threads(peer.pid)
        with SilentFlood(host, port, n=200, source="127.0.0.2", max_s=120) as flood:
            ok = sum(_attempt(peer, seed) for seed in range(10))
            most = max(threads(peer.pid) for _ in range(20))
        assert flood.opened > per_source
        # Threads exiting after an eviction may linger a moment: slack of 8.
        assert most - th0 <= per_source + 8, (th0, most)
        assert ok == 10, f"{ok} of 10"
