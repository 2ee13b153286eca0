"""Control messages, the TCP path's copy-free socket helpers and request cutting.

The handshake and framing are kvmesh.net's (tests/net); range checks: test_ranges.py.
"""

import socket
import struct
import threading

import numpy as np
import pytest

from kvmesh.transfer import InvalidArgument, PeerDeadError, ProtocolError, sockio
from kvmesh.transfer import protocol as P
from kvmesh.transfer.transports import tcp


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
    t = threading.Thread(target=sockio.send_views, args=(a, views_s))
    t.start()
    sockio.recv_into_views(b, views_d)
    t.join()
    assert (src == dst).all()
    a.close()
    b.close()


def test_ranges_move_in_windows_without_a_view_per_piece():
    # More pieces than one window, partial sends and receives on small socket buffers.
    n = tcp.WINDOW * 3 + 17
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    lengths = rng.integers(1, 200, n).astype(np.uint64)
    offsets = (np.arange(n, dtype=np.uint64) * np.uint64(256))[rng.permutation(n)]
    dst = np.zeros_like(src)
    a, b = _pair()
    head = b"HEAD"
    t = threading.Thread(target=tcp.send_ranges, args=(a, memoryview(src), offsets, lengths, head))
    t.start()
    assert b.recv(4, socket.MSG_WAITALL) == head
    tcp.recv_ranges(b, memoryview(dst), offsets, lengths)
    t.join()
    for o, ln in zip(offsets.tolist(), lengths.tolist()):
        assert (dst[o : o + ln] == src[o : o + ln]).all()
    a.close()
    b.close()


def test_request_chunks_respect_piece_and_byte_limits():
    rng = np.random.default_rng(2)
    n = 1000
    ln = rng.integers(1, 5000, n).astype(np.uint64)
    ln[7] = 50_000  # longer than max_bytes: split
    lo = np.cumsum(ln) - ln
    ro = lo[::-1].copy()
    parts = list(tcp.request_chunks(lo, ro, ln, 64, 20_000))
    assert all(len(p[2]) <= 64 and int(p[2].sum()) <= 20_000 for p in parts)
    # Together the parts cover exactly the same bytes, in order.
    cat = [np.concatenate([p[i] for p in parts]) for i in range(3)]
    assert int(cat[2].sum()) == int(ln.sum())
    expand = lambda o, n_: np.concatenate([np.arange(a, a + b) for a, b in zip(o, n_)])  # noqa: E731
    assert (expand(cat[0], cat[2]) == expand(lo, ln)).all()
    assert (expand(cat[1], cat[2]) == expand(ro, ln)).all()
    # Within limits: one part, the arrays as they were.
    (one,) = tcp.request_chunks(lo, ro, ln, 10_000, 1 << 30)
    assert (one[2] == ln).all()


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
    with pytest.raises(ProtocolError, match="limit"):
        P.recv_msg(b)
    a.sendall(struct.pack("<I", 3) + b"\xc1\xc1\xc1")
    with pytest.raises(ProtocolError, match="undecodable"):
        P.recv_msg(b)
    a.close()
    b.close()


def test_split_host_port():
    assert P.split_host_port("10.0.0.1:80") == ("10.0.0.1", 80)
    assert P.split_host_port("[::1]:9") == ("::1", 9)
    with pytest.raises(InvalidArgument):
        P.split_host_port("nohost")
