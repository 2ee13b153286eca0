"""Replica transport: delivery, fragmentation of large messages interleaved with small
ones, bounded queues and unreachable reports, reconnection, malformed frames."""

import asyncio
import socket
import struct

import pytest

from kvmesh.net import SecurityConfig, aclient_handshake, aserver_handshake, eventloop
from kvmesh.replog.net.protocol import PEER_SERVICE
from kvmesh.replog.net.server import free_ports
from kvmesh.replog.net.transport import FRAG, Transport, TransportConfig, _Peer
from kvmesh.replog.types import ConfState, Heartbeat, InstallSnapshot, Snapshot, SnapshotMeta

from ..event_loops import loop_name  # noqa: F401 - a fixture (usefixtures)


class Box:
    def __init__(self):
        self.msgs = []
        self.unreachable = []
        self.snap = []
        self.event = asyncio.Event()

    def on_message(self, m):
        self.msgs.append(m)
        self.event.set()

    async def wait_for(self, n, timeout=10):
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while len(self.msgs) < n:
            self.event.clear()
            await asyncio.wait_for(self.event.wait(), max(0.01, end - loop.time()))
        return self.msgs


def make(i, peers, box, **cfg):
    return Transport(
        i,
        peers[i],
        peers,
        box.on_message,
        on_unreachable=box.unreachable.append,
        on_snapshot_status=lambda p, ok: box.snap.append((p, ok)),
        config=TransportConfig(**cfg),
    )


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_delivery_and_fragmented_snapshot_interleaved():
    async def main():
        p = free_ports(2)
        peers = {1: f"127.0.0.1:{p[0]}", 2: f"127.0.0.1:{p[1]}"}
        a_box, b_box = Box(), Box()
        a = make(1, peers, a_box, fragment_bytes=16 * 1024)
        b = make(2, peers, b_box)
        await a.start()
        await b.start()
        try:
            data = bytes(range(256)) * 1200  # ~300 KB -> ~19 fragments
            snap = InstallSnapshot(1, 2, 5, Snapshot(SnapshotMeta(100, 4, ConfState((1, 2))), data))
            a.send([Heartbeat(1, 2, 5, commit=1, ctx=1), snap])
            a.send([Heartbeat(1, 2, 5, commit=1, ctx=k) for k in range(2, 50)])
            msgs = await b_box.wait_for(50)
            snaps = [m for m in msgs if type(m) is InstallSnapshot]
            assert len(snaps) == 1 and snaps[0].snapshot.data == data
            hbs = [m.ctx for m in msgs if type(m) is Heartbeat]
            assert hbs == list(range(1, 50))  # per-destination order of small messages kept
            # Heartbeats queued behind the snapshot overtook its tail (not blocked by it).
            assert msgs.index(snaps[0]) > 1
            for _ in range(1000):  # a poll: up to 10 s on a loaded machine
                if a_box.snap:
                    break
                await asyncio.sleep(0.01)
            assert a_box.snap == [(2, True)]
            # And the other direction works on B's own connection.
            b.send([Heartbeat(2, 1, 5, commit=0, ctx=7)])
            (m,) = await a_box.wait_for(1)
            assert m.ctx == 7 and m.frm == 2
        finally:
            await a.stop()
            await b.stop()

    run(main())


def test_unknown_peer_and_dead_peer_are_reported_unreachable():
    async def main():
        p = free_ports(2)
        peers = {1: f"127.0.0.1:{p[0]}", 2: f"127.0.0.1:{p[1]}"}  # nobody listens on 2
        box = Box()
        a = make(1, peers, box, connect_timeout_s=0.5, min_backoff_s=0.01, max_backoff_s=0.05)
        await a.start()
        try:
            a.send([Heartbeat(1, 9, 1, commit=0)])
            assert box.unreachable == [9]
            a.send([Heartbeat(1, 2, 1, commit=0)])
            snap = InstallSnapshot(1, 2, 1, Snapshot(SnapshotMeta(1, 1), b"x"))
            a.send([snap])
            for _ in range(1000):
                if 2 in box.unreachable and (2, False) in box.snap:
                    break
                await asyncio.sleep(0.01)
            assert 2 in box.unreachable and (2, False) in box.snap
        finally:
            await a.stop()

    run(main())


def test_bounded_queue_drops_and_reports():
    async def main():
        p = free_ports(2)
        peers = {1: f"127.0.0.1:{p[0]}", 2: f"127.0.0.1:{p[1]}"}
        box = Box()
        a = make(1, peers, box, max_queue_msgs=10, connect_timeout_s=2.0, min_backoff_s=1.0)
        await a.start()
        try:
            # The queue fills before the (failing) connection attempt even finishes.
            a.send([Heartbeat(1, 2, 1, commit=0, ctx=k) for k in range(30)])
            assert box.unreachable.count(2) >= 20
            assert a.stats()[2]["dropped"] >= 20 and a.stats()[2]["queued"] <= 10
        finally:
            await a.stop()

    run(main())


def test_reconnects_after_peer_restart():
    async def main():
        p = free_ports(2)
        peers = {1: f"127.0.0.1:{p[0]}", 2: f"127.0.0.1:{p[1]}"}
        a_box, b_box = Box(), Box()
        a = make(1, peers, a_box, min_backoff_s=0.01, max_backoff_s=0.05)
        b = make(2, peers, b_box)
        await a.start()
        await b.start()
        a.send([Heartbeat(1, 2, 1, commit=0, ctx=1)])
        await b_box.wait_for(1)
        await b.stop()
        # Sends while B is down are dropped (Raft retransmits), not buffered forever.
        for k in range(5):
            a.send([Heartbeat(1, 2, 1, commit=0, ctx=100 + k)])
            await asyncio.sleep(0.02)
        b_box2 = Box()
        b2 = make(2, peers, b_box2)
        await b2.start()
        try:
            for k in range(1000):
                a.send([Heartbeat(1, 2, 1, commit=0, ctx=1000 + k)])
                await asyncio.sleep(0.01)
                if b_box2.msgs:
                    break
            assert b_box2.msgs and b_box2.msgs[-1].ctx >= 1000
            assert 2 in a_box.unreachable
        finally:
            await a.stop()
            await b2.stop()

    run(main())


async def connect_as(port, node_id, sec=None):
    """A raw connection to a replica port, authenticated as ``node_id``."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    await aclient_handshake(
        r, w, sec or SecurityConfig(), PEER_SERVICE, str(node_id), role="replica"
    )
    return r, w


def test_malformed_frames_close_only_that_connection():
    async def main():
        p = free_ports(2)
        peers = {1: f"127.0.0.1:{p[0]}", 2: f"127.0.0.1:{p[1]}"}
        a_box, b_box = Box(), Box()
        b = make(2, peers, b_box)
        await b.start()
        try:
            r, w = await connect_as(p[1], 1)
            w.write(struct.pack("<IB", 4, 9) + b"abc")  # unknown kind
            await w.drain()
            assert await r.read() == b""  # closed by B
            r, w = await connect_as(p[1], 1)
            w.write(struct.pack("<IB", 3, 1) + b"\xc1\xc1")
            await w.drain()
            assert await r.read() == b""
            r, w = await connect_as(p[1], 1)
            w.write(struct.pack("<IB", 100 << 20, FRAG))
            await w.drain()
            assert await r.read() == b""  # oversized frame refused before reading it
            assert b.bad_frames == 3
            a = make(1, peers, a_box)
            await a.start()
            a.send([Heartbeat(1, 2, 1, commit=0, ctx=5)])
            (m,) = await b_box.wait_for(1)
            assert m.ctx == 5
            await a.stop()
        finally:
            await b.stop()

    run(main())


class ResettingPeer:
    """Node 2 as a raw listener: authenticates node 1's connections and counts the frames
    on each; the first connection is reset (RST, as from a killed process with unread
    data) after its first frame."""

    def __init__(self):
        self.frames: list[int] = []  # connection number per frame received
        self.conns = 0
        self.server = None

    async def start(self, port):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", port)

    async def _serve(self, r, w):
        self.conns += 1
        n = self.conns
        try:
            await aserver_handshake(r, w, SecurityConfig(), PEER_SERVICE, "2", 5.0)
            while True:
                (size,) = struct.unpack("<I", await r.readexactly(4))
                await r.readexactly(size)
                self.frames.append(n)
                if n == 1:
                    sock = w.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    w.transport.abort()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async def stop(self):
        self.server.close()


@pytest.mark.usefixtures("loop_name")
def test_sender_survives_a_reset_connection():
    """uvloop raises RuntimeError (not ConnectionResetError) on a write to a connection the
    peer reset; the sender must reconnect on both event loops, not end (issue 16)."""

    async def main():
        p = free_ports(2)
        peers = {1: f"127.0.0.1:{p[0]}", 2: f"127.0.0.1:{p[1]}"}
        fake = ResettingPeer()
        await fake.start(p[1])
        a = make(1, peers, Box(), min_backoff_s=0.01, max_backoff_s=0.05)
        await a.start()
        try:
            loop = asyncio.get_running_loop()
            end = loop.time() + 10
            k = 0
            while 2 not in fake.frames and loop.time() < end:
                k += 1
                a.send([Heartbeat(1, 2, 1, commit=0, ctx=k)])
                await asyncio.sleep(0.01)
            assert 2 in fake.frames, (
                f"no frame on a new connection after the reset ({fake.conns} connections, "
                f"sender {a.stats()[2]})"
            )
            assert a.stats()[2]["errors"] >= 1
            assert a._peers[2].task is not None and not a._peers[2].task.done()
        finally:
            await a.stop()
            await fake.stop()

    eventloop.run(asyncio.wait_for(main(), 60))


class Boom(BaseException):
    """Not an Exception: what no ``except Exception`` catches (a stand-in for a bug)."""


@pytest.mark.usefixtures("loop_name")
def test_a_sender_that_ends_is_restarted(monkeypatch):
    """Whatever ends a sender task, its supervisor restarts it (no silent death)."""
    calls = []
    real = _Peer._connect

    async def connect_once_boom(self):
        calls.append(1)
        if len(calls) == 1:
            raise Boom("planted")
        return await real(self)

    monkeypatch.setattr(_Peer, "_connect", connect_once_boom)

    async def main():
        p = free_ports(2)
        peers = {1: f"127.0.0.1:{p[0]}", 2: f"127.0.0.1:{p[1]}"}
        b_box = Box()
        a = make(1, peers, Box(), min_backoff_s=0.01, max_backoff_s=0.05)
        b = make(2, peers, b_box)
        await a.start()
        await b.start()
        try:
            loop = asyncio.get_running_loop()
            end = loop.time() + 10
            k = 0
            while not b_box.msgs and loop.time() < end:
                k += 1
                a.send([Heartbeat(1, 2, 1, commit=0, ctx=k)])
                await asyncio.sleep(0.01)
            assert b_box.msgs, f"the sender never came back: {a.stats()[2]}"
            assert a.stats()[2]["restarts"] == 1
        finally:
            await a.stop()
            await b.stop()

    eventloop.run(asyncio.wait_for(main(), 60))
