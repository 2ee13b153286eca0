"""Framing, copy-free socket helpers, authentication MACs."""

import socket
import struct
import threading

import numpy as np
import pytest

from kvmesh.transfer import PeerDeadError, ProtocolError
from kvmesh.transfer import protocol as P


def _pair(bufsize=4096):
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, bufsize)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, bufsize)
    return a, b


def test_scatter_gather_survives_partial_sends_and_receives():
    rng = np.random.default_rng(0)
    sizes = [1, 3, 4096, 70_000, 5, 200_000, 17] * 20 + [1] * 600  # > one iovec batch
    src = rng.integers(0, 256, sum(sizes), dtype=np.uint8)
    dst = np.zeros_like(src)
    a, b = _pair()
    smv, dmv = memoryview(src), memoryview(dst)
    views_s, views_d, pos = [], [], 0
    for n in sizes:
        views_s.append(smv[pos : pos + n])
        views_d.append(dmv[pos : pos + n])
        pos += n
    t = threading.Thread(target=P.send_views, args=(a, views_s))
    t.start()
    P.recv_into_views(b, views_d)
    t.join()
    assert (src == dst).all()
    a.close()
    b.close()


def test_frames_roundtrip_and_eof_is_peer_death():
    a, b = socket.socketpair()
    P.send_msg(a, P.Ping(42))
    P.send_msg(a, P.Error("auth", "nope"))
    assert P.recv_msg(b) == P.Ping(42)
    assert P.recv_msg(b) == P.Error("auth", "nope")
    a.close()
    with pytest.raises(PeerDeadError):
        P.recv_msg(b)
    b.close()


def test_oversized_and_garbage_frames_are_protocol_errors():
    a, b = socket.socketpair()
    a.sendall(struct.pack("<I", P.MAX_FRAME + 1))
    with pytest.raises(ProtocolError, match="exceeds"):
        P.recv_msg(b)
    a.sendall(struct.pack("<I", 3) + b"\xc1\xc1\xc1")
    with pytest.raises(ProtocolError, match="undecodable"):
        P.recv_msg(b)
    a.close()
    b.close()


def test_mac_requires_the_same_token_on_both_sides():
    nonce = b"n" * 16
    m = P.mac("secret", nonce, "engine")
    assert P.mac_ok("secret", nonce, "engine", m)
    assert not P.mac_ok("other", nonce, "engine", m)
    assert not P.mac_ok("secret", nonce, "another-engine", m)
    assert not P.mac_ok("secret", nonce, "engine", None)
    assert not P.mac_ok(None, nonce, "engine", m)
    assert P.mac_ok(None, nonce, "engine", None)


def test_split_host_port():
    assert P.split_host_port("10.0.0.1:80") == ("10.0.0.1", 80)
    assert P.split_host_port("[::1]:9") == ("::1", 9)
    with pytest.raises(Exception):
        P.split_host_port("nohost")
