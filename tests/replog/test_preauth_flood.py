"""A connect flood without the token against a restarted replica (issue 16, part 3).

About 9,000 connects/s at a restarted follower's raft port kept it from applying anything
for 13 s: asyncio's accept path (a transport and a task per connection, 100 per loop
iteration) drained ~1,300 connections a second, the accept queue stayed full and the
kernel dropped the leader's SYNs. The shared listener (kvmesh.net.listener) accepts in a
tight loop and refuses the flood at accept cost (docs/net.md, "Connect floods").
"""

from __future__ import annotations

import time

import pytest

from kvmesh.replog.net.server import LocalCluster
from kvmesh.replog.net.transport import parse_addr

from ..net.flood import SilentFlood, start_connect_flood, stop_connect_flood
from .test_hostile import TICK_MS, TOKEN, client, leader_status, put_many, run, statuses

FLOOD_S = 60.0  # an upper bound: the test stops its flood once the follower caught up
CATCH_UP_S = 10.0
# Below this the flood proves little (the issue measured ~9,000/s; one flooding process
# reaches 8-20 thousand here when it gets a CPU).
MIN_RATE = 3000


def test_a_restarted_follower_catches_up_under_a_connect_flood(tmp_path):
    cluster = LocalCluster(str(tmp_path), 3, tick_ms=TICK_MS, election_ticks=10, token=TOKEN)
    flood = None
    try:
        cluster.start_all()

        async def main():
            nonlocal flood
            lid, _ = await leader_status(cluster)
            f = next(i for i in cluster.ids if i != lid)
            async with client(cluster) as c:
                await put_many(c, "a", 50)
                cluster.kill(f)
                await put_many(c, "b", 300)
            target = (await statuses(cluster))[lid]["commit"]
            host, port = parse_addr(cluster.peers[f])
            # The attacker is another host (127.0.0.2); the replicas are on 127.0.0.1.
            flood = [start_connect_flood(host, port, FLOOD_S, source="127.0.0.2")]
            flood_t0 = time.monotonic()
            time.sleep(1.0)  # let it ramp up (a flood that has not started proves nothing)
            assert all(p.poll() is None for p in flood), "a flood process died"
            cluster.start(f)
            t0 = time.monotonic()
            applied = -1
            while time.monotonic() - t0 < CATCH_UP_S:
                st = (await statuses(cluster)).get(f)
                applied = st["applied"] if st else -1
                if applied >= target:
                    break
                time.sleep(0.1)
            took = time.monotonic() - t0
            assert all(p.poll() is None for p in flood), "the flood ended too early"
            flooded = time.monotonic() - flood_t0
            return f, applied, target, took, flooded

        f, applied, target, took, flooded = run(main(), timeout=120)
        # The flood ran from before the restart until the catch-up ended (it was alive then).
        rate = sum(stop_connect_flood(p) for p in flood) / flooded
        print(f"flood: {rate:.0f} connects/s; follower caught up in {took:.2f} s")
        if rate < MIN_RATE:
            pytest.skip(f"the flood reached only {rate:.0f} connects/s here")
        assert applied >= target, (
            f"replica {f} applied {applied} of {target} within {CATCH_UP_S} s under the flood"
        )
    finally:
        for p in flood or ():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        cluster.close()


def test_silent_connections_from_a_clients_own_address_do_not_lock_it_out(tmp_path):
    """100 silent connections from the clients' own address, each reopened the moment the
    server closes it (evicted, dropped or at its deadline). Before, a refused connection was
    held, then reset, and each slot the source freed went to whoever asked first -- mostly
    the flood's own reconnects: an honest client got in 30-39 times of 40 in its 1 s attempt.
    Now the listener greets every connection and a waiting one that answered goes ahead of
    its source's silent ones (kvmesh.net.admission.Gate.spoke): it waits at most about one
    minimum handshake age (0.25 s), whatever the machine's speed."""
    cluster = LocalCluster(str(tmp_path), 3, tick_ms=TICK_MS, election_ticks=10, token=TOKEN)
    try:
        cluster.start_all()

        async def main():
            lid, _ = await leader_status(cluster)
            host, port = parse_addr(cluster.client_addrs[lid])
            ok = 0
            with SilentFlood(host, port, n=100, max_s=60) as flood:
                for _ in range(40):
                    try:
                        async with client(cluster, timeout=3.0) as c:
                            await c.status(cluster.client_addrs[lid])
                        ok += 1
                    except (TimeoutError, OSError, ConnectionError):
                        pass
                held = len(flood._sel.get_map())
            return ok, flood.opened, held

        ok, opened, held = run(main(), timeout=120)
        print(f"honest clients in: {ok} of 40; flood opened {opened}, held {held}")
        assert opened >= 32 and held >= 16, (opened, held)  # it did fill the source's slots
        assert ok >= 39, f"an honest client got in {ok} times of 40"
    finally:
        cluster.close()
