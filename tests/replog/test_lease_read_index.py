"""``RaftNode.lease_read_index``: a leader holding its lease answers the read barrier at once
(no Ready round trip) with the index the core would report; without a lease (SAFE mode, a
follower, a leader cut off from its quorum) it declines and reads go through the core."""

from __future__ import annotations

import asyncio

from kvmesh.replog.types import RaftConfig, ReadOnlyOption

from .test_node import Cluster, run

LEASE = RaftConfig(
    election_tick=10,
    max_election_tick=20,
    heartbeat_tick=1,
    read_only_option=ReadOnlyOption.LEASE_BASED,
)


def test_leader_with_lease_answers_at_once(tmp_path) -> None:
    async def main() -> None:
        async with Cluster(tmp_path, durability="memory", raft=LEASE) as c:
            leader = await c.leader()
            await c.put("a", b"1")
            for _ in range(250):  # the lease is confirmed by heartbeat acks (a poll)
                if leader.lease_read_index() is not None:
                    break
                await asyncio.sleep(0.02)
            before = leader.metrics["lease_reads"]
            idx = leader.lease_read_index()
            assert idx is not None and idx == leader.status()["commit"] == leader.applied_index
            assert await leader.read_index() == idx
            assert leader.metrics["lease_reads"] == before + 2
            assert await leader.linearizable_read(lambda sm: sm.get("a")) == b"1"
            followers = [n for n in c.nodes.values() if n is not leader]
            assert all(n.lease_read_index() is None for n in followers)
            # cut the leader off: once its lease runs out it must stop answering alone
            for i, n in list(c.nodes.items()):
                if n is not leader:
                    await c.stop(i)
            await asyncio.sleep(0.02 * 25)
            assert leader.lease_read_index() is None

    run(main())


def test_safe_mode_never_answers_from_a_lease(tmp_path) -> None:
    async def main() -> None:
        safe = RaftConfig(election_tick=10, max_election_tick=20, heartbeat_tick=1)
        async with Cluster(tmp_path, durability="memory", raft=safe) as c:
            leader = await c.leader()
            await c.put("a", b"1")
            await asyncio.sleep(0.2)
            assert leader.lease_read_index() is None
            assert await leader.read_index() >= 1
            assert leader.metrics["lease_reads"] == 0

    run(main())
