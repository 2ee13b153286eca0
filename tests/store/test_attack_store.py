"""Adversarial tests against a LIVE store master process (regressions of defects found by
attacking it): requests that must be refused without side effects, replies that must stay
bounded whatever a peer asks for, and storage-node identities a peer cannot take over.
Each test measures the master process (RSS, threads, fds) where the defect was a resource
one, and checks afterwards that a legitimate client still gets byte-exact data."""

from __future__ import annotations

import os
import socket
import time

import pytest

from kvmesh.net import framing
from kvmesh.net.handshake import client_handshake
from kvmesh.net.limits import Deadline
from kvmesh.net.security import SecurityConfig
from kvmesh.store import StoreClient
from kvmesh.store import errors as E
from kvmesh.store import protocol as P
from kvmesh.store.cluster import StoreCluster
from kvmesh.store.types import ReplicateConfig

from .e2e_util import TOKEN


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    d = tmp_path_factory.mktemp("store-attack")
    cl = StoreCluster(
        str(d), 1, token=TOKEN, durability="memory", extra_args=["--lease-ttl-s", "1"]
    )
    cl.start_all()
    client = StoreClient(cl.address, token=TOKEN, timeout=10, segment_size=8 << 20)
    try:
        yield cl, client
    finally:
        client.close()
        cl.close()


def _proc(cl: StoreCluster) -> dict[str, int]:
    """RSS (KiB), peak RSS (KiB), threads and open fds of the master process."""
    pid = cl.procs[1].pid
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("VmRSS", "VmHWM", "Threads"):
                out[k] = int(v.split()[0])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


class Peer:
    """An authenticated raw connection speaking the store protocol (a hostile client)."""

    def __init__(self, cl: StoreCluster, name: str = "attacker") -> None:
        host, port = cl.addrs[1].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        client_handshake(self.sock, SecurityConfig(token=TOKEN), P.SERVICE, name, 5.0)
        self.seq = 0
        self.cid = self.call(P.RegisterReq(1)).client_id

    def call(self, req, timeout: float = 30.0, max_reply: int = 1 << 30):
        self.sock.sendall(framing.encode_frame(P.encode(req)))
        return P.decode_response(framing.read_frame(self.sock, max_reply, Deadline(timeout)))

    def session(self) -> P.Session:
        self.seq += 1
        return P.Session(self.cid, self.seq, self.seq)

    def close(self) -> None:
        self.sock.close()


def _byte_exact(client: StoreClient, values: dict[str, bytes]) -> None:
    res = client.get(list(values))
    assert list(res) == list(values.values())


def test_a_put_that_can_never_fit_does_not_evict_the_pool(master):
    """A put asking for more than the whole pool (or an invalid copy count) used to make
    the leader evict every unleased object before apply refused it with NoSpace or
    InvalidParams: one request wiped the cache."""
    cl, client = master
    values = {f"fit-{i}": bytes([i]) * 65536 for i in range(20)}
    assert client.put(list(values), list(values.values())).codes == [0] * 20
    time.sleep(1.2)  # past the read leases of the put's own reads (lease TTL 1 s)
    p = Peer(cl)
    try:
        for sizes, cfg in [
            ([1 << 40], ReplicateConfig()),  # 1 TiB into an 8 MiB pool
            ([1 << 20] * 8, ReplicateConfig(replica_num=1000)),  # invalid copy count
            ([4 << 20, 4 << 20], ReplicateConfig(replica_num=2)),  # 2 copies, 1 node
        ]:
            keys = [f"never-{cfg.replica_num}-{i}" for i in range(len(sizes))]
            r = p.call(P.PutStartReq(7, p.session(), keys, sizes, cfg))
            if type(r) is P.PutStartResp:
                assert all(c != 0 for c in r.codes), r
            else:
                assert type(r) is P.ErrorResp and r.code == E.InvalidParams.code, r
            assert all(client.exists(list(values))), f"{sizes} x{cfg.replica_num} evicted objects"
    finally:
        p.close()
    _byte_exact(client, values)
    client.remove(list(values))
