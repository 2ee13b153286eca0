"""Servers listen on IPv6 addresses where given (issue 16, part 5): ``[::1]:port`` used to
create an IPv4 socket (transfer) or fail to parse (replog, store). Skipped where the host has
no IPv6 loopback."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")


def test_transfer_engine_listens_and_serves_on_ipv6_loopback():
    from kvmesh.transfer import EngineConfig, Op, TransferEngine

    owner = TransferEngine(config=EngineConfig(listen="[::1]:0", transport="tcp", host_id="a"))
    user = TransferEngine(config=EngineConfig(transport="tcp", host_id="b"))
    try:
        assert owner.address.startswith("[::1]:"), owner.address
        pool = owner.register(np.zeros(1 << 16, np.uint8))
        owner.publish(pool, "pool")
        seg = user.open_segment(owner.address, "pool")
        src = user.register(np.arange(1 << 16, dtype=np.uint64).view(np.uint8)[: 1 << 16].copy())
        user.transfer(Op.WRITE, src, np.array([0]), seg, np.array([0]), 1 << 16)
        assert (pool.array() == src.array()).all()
    finally:
        user.close()
        owner.close()


def test_replog_cluster_runs_on_ipv6_loopback(tmp_path):
    from kvmesh.replog.net.client import KvClient
    from kvmesh.replog.net.server import LocalCluster

    cluster = LocalCluster(str(tmp_path), 3, tick_ms=50, host="::1", token="v6-secret")
    try:
        assert all(a.startswith("[::1]:") for a in cluster.peers.values())
        cluster.start_all()

        async def main():
            async with KvClient(cluster.client_addrs, security=cluster.security, timeout=20) as c:
                await c.put("k", b"v6")
                assert await c.get("k") == b"v6"

        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        cluster.close()
