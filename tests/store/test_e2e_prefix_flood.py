"""Remove-by-prefix floods against a live master. A round scans the whole key table (work
per request grows with the table, not the request), and scans run one at a time: without a
bound, every authenticated connection could queue ``max_inflight`` of them and an honest
``remove_prefix`` waited behind all of them (measured: 30 connections x 64 pipelined
requests on 40,000 keys held an honest call 10 s and the master's CPU busy meanwhile).
Now a connection has at most one scan queued and the master at most ``MAX_SCANS``; past
that a request is answered at once, retryably."""

from __future__ import annotations

import time

import pytest

from kvmesh.net import framing
from kvmesh.net.limits import Deadline
from kvmesh.store import StoreClient
from kvmesh.store import errors as E
from kvmesh.store import protocol as P
from kvmesh.store.cluster import StoreCluster
from kvmesh.store.service import MAX_SCANS

from .e2e_util import TOKEN
from .test_attack_store import Peer

KEYS = 40_000


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    cl = StoreCluster(
        str(tmp_path_factory.mktemp("prefix-flood")), 1, token=TOKEN, durability="memory"
    )
    cl.start_all()
    client = StoreClient(cl.address, token=TOKEN, timeout=20, segment_size=32 << 20)
    try:
        for i in range(0, KEYS, 8000):
            client.put([f"k/{j:06d}" for j in range(i, i + 8000)], [b"v" * 8] * 8000)
        yield cl, client
    finally:
        client.close()
        cl.close()


def _flood(peers: list[Peer], per_peer: int) -> list:
    """Each peer pipelines ``per_peer`` rounds of a prefix matching nothing; their replies."""
    for p in peers:
        p.sock.sendall(
            b"".join(
                framing.encode_frame(P.encode(P.RemovePrefixReq(100 + q, p.session(), "none/")))
                for q in range(per_peer)
            )
        )
    return [
        P.decode_response(framing.read_frame(p.sock, 1 << 20, Deadline(60.0)))
        for p in peers
        for _ in range(per_peer)
    ]


def test_scans_past_the_bound_are_answered_busy_at_once(master):
    cl, client = master
    peers = [Peer(cl, f"flood-{i}") for i in range(3 * MAX_SCANS)]
    try:
        replies = _flood(peers, 1)
    finally:
        for p in peers:
            p.close()
    done = [r for r in replies if type(r) is P.RemovePrefixResp]
    busy = [r for r in replies if type(r) is P.ErrorResp]
    assert len(done) + len(busy) == len(replies)
    assert done and all(r.removed == 0 for r in done)
    assert len(busy) >= MAX_SCANS, (len(done), len(busy))
    assert all(r.code == E.StoreUnavailable.code and r.retry for r in busy), busy[:3]
    assert client.remove_prefix("k/00000") == 10  # an honest call retries through it


def test_one_connection_queues_one_scan_at_a_time(master):
    """A connection that pipelines many rounds has them run one after another: it never
    fills the master's bound alone, and an honest call meanwhile waits one scan, not all."""
    cl, client = master
    p = Peer(cl, "pipeliner")
    try:
        p.sock.sendall(
            b"".join(
                framing.encode_frame(P.encode(P.RemovePrefixReq(100 + q, p.session(), "none/")))
                for q in range(4 * MAX_SCANS)
            )
        )
        t0 = time.monotonic()
        assert client.remove_prefix("k/00001") == 10
        honest = time.monotonic() - t0
        replies = [
            P.decode_response(framing.read_frame(p.sock, 1 << 20, Deadline(60.0)))
            for _ in range(4 * MAX_SCANS)
        ]
    finally:
        p.close()
    assert all(type(r) is P.RemovePrefixResp for r in replies), replies[:3]
    assert honest < 5.0, honest


def test_an_empty_or_invalid_prefix_is_refused_and_removes_nothing(master):
    """An empty prefix would name every key: the master refuses it (remove_all is the
    request for that), as it refuses a prefix no key could start with (NUL, too long)."""
    cl, client = master
    p = Peer(cl, "prefixes")
    try:
        for prefix in ("", "k/\0", "k" * 1025):
            r = p.call(P.RemovePrefixReq(7, p.session(), prefix))
            assert type(r) is P.ErrorResp and r.code == E.InvalidKey.code, (prefix[:8], r)
    finally:
        p.close()
    with pytest.raises(E.InvalidKey):
        client.remove_prefix("")
    assert client.exists("k/000200") and client.exists(f"k/{KEYS - 1:06d}")
