"""The owner's half of the TCP path on a disk segment (``DiskSegment.serve_read`` /
``serve_write``): the next part moves on the disk while this one moves through the socket.

The server side runs in the test thread on one end of a socketpair with small buffers; a
peer thread plays the remote engine on the other end. Overlap is shown, not timed: a disk
call that waits for the socket's progress (or the other way round) finishes only when the
two really run at the same time, and a sequential owner leaves the wait to time out.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvmesh.transfer import Op, PeerDeadError
from kvmesh.transfer import disk as D
from kvmesh.transfer.errors import DiskIOError

from .util import pattern

MiB = 1 << 20
PART = D.STAGE_BYTES // 2  # the owner moves a request in runs of this many bytes
HEAD = b"head-of-the-reply"
WAIT_S = 5.0  # how long a planted wait gives the other side (generous: CI is loaded)


def _pair():
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        s.settimeout(30)
    return a, b


def _segment(tmp_path, nparts: int):
    seg = D.open_disk(tmp_path / "seg", nparts * PART)
    data = pattern(5, 0, nparts * PART)
    one = np.array([0], np.uint64)
    seg.io(Op.WRITE, data, one, one, np.array([len(data)], np.uint64))
    return seg, data


def _recv(sock, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(min(1 << 20, n - len(out)))
        if not got:
            break
        out += got
    return bytes(out)


def _spy_io(monkeypatch, hook):
    """Run ``hook(op, first segment offset)`` before each disk call of the segment."""
    real = D.DiskSegment.io

    def io(self, op, mem, mem_offsets, seg_offsets, lengths, check=None):
        hook(op, int(seg_offsets[0]) if len(seg_offsets) else -1)
        return real(self, op, mem, mem_offsets, seg_offsets, lengths, check)

    monkeypatch.setattr(D.DiskSegment, "io", io)


def _whole(n: int):
    return np.array([0], np.uint64), np.array([n], np.uint64)


def test_read_reads_the_next_part_while_this_one_is_sent(tmp_path, monkeypatch):
    seg, data = _segment(tmp_path, 4)
    next_read = threading.Event()
    _spy_io(monkeypatch, lambda op, off: off == PART and next_read.set())
    srv, peer = _pair()
    got: dict = {}

    def remote():
        # Hold back 1 MiB of part 0 (more than the socket buffers): a sequential owner is
        # stuck sending part 0 and never starts reading part 1.
        first = _recv(peer, len(HEAD) + PART - MiB)
        got["overlap"] = next_read.wait(WAIT_S)
        got["bytes"] = first + _recv(peer, MiB + 3 * PART)

    t = threading.Thread(target=remote)
    t.start()
    try:
        assert seg.serve_read(srv, *_whole(4 * PART), HEAD, None) is None
    finally:
        t.join(60)
        srv.close(), peer.close()
    assert got["overlap"], "part 1 was not read while part 0 was being sent"
    assert got["bytes"] == HEAD + data.tobytes()
    seg.close(5)


def test_write_receives_the_next_part_while_this_one_is_written(tmp_path, monkeypatch):
    seg, _ = _segment(tmp_path, 4)
    new = pattern(9, 0, 4 * PART)
    sent = [0]
    seen: dict = {}

    def hook(op, off):
        if op is Op.WRITE and off == 0:
            # Part 0's write waits until the peer got all of part 1 out: only an owner that
            # receives part 1 during this write lets it.
            end = time.monotonic() + WAIT_S
            while sent[0] < 2 * PART and time.monotonic() < end:
                time.sleep(0.005)
            seen["overlap"] = sent[0] >= 2 * PART

    _spy_io(monkeypatch, hook)
    srv, peer = _pair()

    def remote():
        view = memoryview(new)
        for a in range(0, len(view), 256 << 10):
            peer.sendall(view[a : a + (256 << 10)])
            sent[0] = a + (256 << 10)

    t = threading.Thread(target=remote)
    t.start()
    try:
        assert seg.serve_write(srv, *_whole(4 * PART), None) is None
    finally:
        t.join(60)
        srv.close(), peer.close()
    assert seen["overlap"], "part 1 was not received while part 0 was being written"
    back = np.zeros(4 * PART, np.uint8)
    seg.io(Op.READ, back, *(np.array([0], np.uint64),) * 2, np.array([4 * PART], np.uint64))
    assert (back == new).all()
    seg.close(5)


@pytest.mark.parametrize("bad", [1, 3], ids=["mid-stream", "last-part"])
def test_a_refused_write_is_answered_after_the_rest_is_drained(tmp_path, monkeypatch, bad):
    seg, old = _segment(tmp_path, 4)

    def hook(op, off):
        if op is Op.WRITE and off == bad * PART:
            raise DiskIOError("planted: the device refused")

    _spy_io(monkeypatch, hook)
    srv, peer = _pair()
    new = pattern(11, 0, 4 * PART)
    t = threading.Thread(target=lambda: peer.sendall(new))
    t.start()
    try:
        failed = seg.serve_write(srv, *_whole(4 * PART), None)
        # Every payload byte was consumed: the next request on this connection is in step.
        peer.sendall(b"next")
        assert _recv(srv, 4) == b"next"
    finally:
        t.join(60)
        srv.close(), peer.close()
    assert isinstance(failed, DiskIOError) and "planted" in str(failed)
    back = np.zeros(PART, np.uint8)
    seg.io(Op.READ, back, *(np.array([0], np.uint64),) * 2, np.array([PART], np.uint64))
    assert (back == new[:PART]).all()  # the parts before the refused one landed
    seg.close(5)


def test_a_failed_first_read_is_answered_and_a_later_one_closes(tmp_path, monkeypatch):
    seg, data = _segment(tmp_path, 4)
    bad = {"off": 0}

    def hook(op, off):
        if op is Op.READ and off == bad["off"]:
            raise DiskIOError("planted: unreadable")

    _spy_io(monkeypatch, hook)
    srv, peer = _pair()
    try:
        failed = seg.serve_read(srv, *_whole(4 * PART), HEAD, None)
        assert isinstance(failed, DiskIOError)  # answered instead of the head
        peer.setblocking(False)
        with pytest.raises(BlockingIOError):
            peer.recv(1)  # nothing was sent
        peer.setblocking(True)
        bad["off"] = 2 * PART
        got: dict = {}
        t = threading.Thread(target=lambda: got.setdefault("b", _recv(peer, 4 * PART)))
        t.start()
        with pytest.raises(DiskIOError, match="planted"):
            seg.serve_read(srv, *_whole(4 * PART), HEAD, None)
        srv.shutdown(socket.SHUT_WR)
        t.join(60)
        # The head and the parts before the failed one went out, nothing after them.
        assert got["b"] == HEAD + data[: 2 * PART].tobytes()
    finally:
        srv.close(), peer.close()
    seg.close(5)


def _slow_part(monkeypatch, op, off):
    """The disk call of ``op`` at ``off`` takes 0.5 s: events set as it starts and ends."""
    started, ended = threading.Event(), threading.Event()

    def hook(o, at):
        if o is op and at == off:
            started.set()
            time.sleep(0.5)
            ended.set()

    _spy_io(monkeypatch, hook)
    return started, ended


def test_a_stage_is_never_reused_while_a_disk_thread_still_fills_it(tmp_path, monkeypatch):
    """The peer dies while part 0 is being written: the owner raises only once that write is
    over, so the staging buffer it gives back is not in use."""
    seg, _ = _segment(tmp_path, 4)
    started, ended = _slow_part(monkeypatch, Op.WRITE, 0)
    srv, peer = _pair()

    def remote():
        peer.sendall(memoryview(pattern(3, 0, PART + MiB)))
        started.wait(60)
        peer.close()

    t = threading.Thread(target=remote)
    t.start()
    try:
        with pytest.raises(PeerDeadError):
            seg.serve_write(srv, *_whole(4 * PART), None)
        assert ended.is_set(), "raised while part 0's write still used its stage"
    finally:
        t.join(60)
        srv.close()
    assert len(seg._stages) == 2  # both stages came back
    seg.close(5)


def test_a_peer_gone_mid_read_ends_the_serve_after_the_disk_thread(tmp_path, monkeypatch):
    """The remote end closes after part of the reply: the owner's send fails, and it
    returns only once the read running ahead is over, with both stages given back."""
    seg, _ = _segment(tmp_path, 4)
    started, ended = _slow_part(monkeypatch, Op.READ, PART)
    srv, peer = _pair()

    def remote():
        _recv(peer, len(HEAD) + MiB)
        started.wait(60)
        peer.close()

    t = threading.Thread(target=remote)
    t.start()
    try:
        with pytest.raises((PeerDeadError, OSError)):
            seg.serve_read(srv, *_whole(4 * PART), HEAD, None)
        assert ended.is_set(), "returned while part 1's read still used its stage"
    finally:
        t.join(60)
        srv.close()
    assert len(seg._stages) == 2
    seg.close(5)
