"""Frames: the sans-I/O decoder, the blocking reader's memory bounds, the asyncio reader."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
import tracemalloc

import pytest

from kvmesh.net import (
    Deadline,
    DeadlineExceeded,
    FrameDecoder,
    FrameTooLarge,
    PeerClosed,
    ReadTimer,
    aread_frame,
    encode_frame,
    read_frame,
    send_frame,
)


def test_decoder_splits_any_chunking():
    bodies = [b"", b"a", b"hello" * 100, bytes(range(256)) * 300]
    stream = b"".join(encode_frame(b) for b in bodies)
    for step in (1, 3, 4, 7, 1000, len(stream)):
        dec = FrameDecoder(1 << 20)
        got: list[bytes] = []
        for i in range(0, len(stream), step):
            got += dec.feed(stream[i : i + step])
        assert got == bodies
        assert dec.buffered == 0


def test_decoder_refuses_large_prefix_and_never_preallocates():
    dec = FrameDecoder(64 << 20)
    # 64 MiB announced (allowed), 10 bytes sent: only what arrived is held.
    assert dec.feed(struct.pack("<I", 64 << 20) + b"x" * 10) == []
    assert dec.buffered <= 14
    dec2 = FrameDecoder(4096)
    with pytest.raises(FrameTooLarge):
        dec2.feed(encode_frame(b"ok") + struct.pack("<I", 4097))
    dec3 = FrameDecoder(4096)
    with pytest.raises(FrameTooLarge):
        dec3.feed(b"\xff\xff")
        dec3.feed(b"\xff\xff")


def test_read_frame_roundtrip_and_stops_at_frame_end():
    a, b = socket.socketpair()
    big = bytes(range(256)) * 8192  # 2 MiB: exercises the growing path
    t = threading.Thread(target=lambda: (send_frame(a, encode_frame(big)), a.sendall(b"RAW")))
    t.start()
    assert bytes(read_frame(b, 4 << 20)) == big
    t.join()
    # Raw bytes after the frame are still in the socket.
    assert b.recv(3) == b"RAW"
    send_frame(a, encode_frame(b""), Deadline(1))
    assert read_frame(b, 10, Deadline(1)) == b""
    a.close()
    b.close()


def test_read_frame_memory_grows_only_with_arrived_bytes():
    a, b = socket.socketpair()
    # A peer that may send 64 MiB frames (authenticated) announces one, sends 200 KiB, dies.
    a.sendall(struct.pack("<I", 64 << 20) + b"y" * (200 << 10))
    a.close()
    tracemalloc.start()
    try:
        with pytest.raises(PeerClosed):
            read_frame(b, 64 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, peak  # not 64 MiB
    b.close()


def test_read_frame_limits_and_deadline():
    a, b = socket.socketpair()
    a.sendall(struct.pack("<I", 1 << 30))
    with pytest.raises(FrameTooLarge):
        read_frame(b, 64 << 20)
    a.close()
    b.close()
    a, b = socket.socketpair()
    a.sendall(struct.pack("<I", 10) + b"abc")
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        read_frame(b, 100, Deadline(0.2))
    assert time.monotonic() - t0 < 1.0
    a.close()
    b.close()


def test_aread_frame():
    async def main():
        reader = asyncio.StreamReader()
        big = b"z" * 300_000
        reader.feed_data(encode_frame(b"one") + encode_frame(big) + struct.pack("<I", 9999))
        assert await aread_frame(reader, 1 << 20) == b"one"
        assert await aread_frame(reader, 1 << 20) == big
        with pytest.raises(FrameTooLarge):
            await aread_frame(reader, 4096)
        r2 = asyncio.StreamReader()
        r2.feed_data(struct.pack("<I", 10) + b"ab")
        r2.feed_eof()
        with pytest.raises(PeerClosed):
            await aread_frame(r2, 100)

    asyncio.run(main())


def test_aread_frame_body_deadline():
    async def main():
        r = asyncio.StreamReader()
        r.feed_data(struct.pack("<I", 100_000) + b"x" * 1000)  # begun, then silence
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await aread_frame(r, 1 << 20, frame_timeout=0.2)
        assert time.monotonic() - t0 < 1.0
        idle = asyncio.StreamReader()  # no prefix yet: frame_timeout does not apply
        with pytest.raises(TimeoutError) as ei:
            await asyncio.wait_for(aread_frame(idle, 100, frame_timeout=0.05), 0.3)
        assert not isinstance(ei.value, DeadlineExceeded)  # the caller's idle bound fired
        ok = asyncio.StreamReader()
        ok.feed_data(encode_frame(b"fine"))
        assert await aread_frame(ok, 100, frame_timeout=0.2) == b"fine"

    asyncio.run(main())


async def _timed_read(reader, timer, idle, frame_timeout):
    """What a server's read loop does with a ReadTimer: (body or "expired", seconds)."""
    t0 = time.monotonic()
    timer.arm(idle)
    try:
        body = await aread_frame(reader, 1 << 20, frame_timeout=frame_timeout, timer=timer)
    except asyncio.CancelledError:
        if not timer.expired:
            raise  # cancelled from outside
        return "expired", time.monotonic() - t0
    timer.disarm()
    return body, time.monotonic() - t0


def _in_task(coro_fn, period):
    """Run ``coro_fn(timer)`` as a task owning a ReadTimer of ``period`` seconds."""

    async def main():
        async def body():
            task = asyncio.current_task()
            timer = ReadTimer(task, period)
            try:
                return await coro_fn(timer)
            finally:
                timer.close()

        return await asyncio.create_task(body())

    return asyncio.run(main())


def test_read_timer_idle_deadline_cancels_only_the_read():
    async def run(timer):
        silent = asyncio.StreamReader()
        return await _timed_read(silent, timer, 0.3, 5.0)

    got, took = _in_task(run, 0.1)
    assert got == "expired" and 0.25 <= took < 1.0


async def _begun_after_idling(timer):
    """A connection idle past one timer period under a long idle deadline, then a frame
    that begins and stalls: it must end at frame_timeout (0.3 s) after it began."""
    r = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    loop.call_later(0.45, r.feed_data, struct.pack("<I", 1000) + b"x" * 10)
    got, took = await _timed_read(r, timer, 30.0, 0.3)
    return got, took - 0.45


def test_read_timer_frame_deadline_is_the_earlier_one():
    """A begun frame must end within frame_timeout even under a long idle deadline (also
    after the timer already fired once during the idle wait), and an idle deadline shorter
    than frame_timeout still holds once the prefix arrived."""
    got, after = _in_task(_begun_after_idling, 0.3)
    assert got == "expired" and 0.25 <= after < 1.0

    async def idle_first(timer):
        r = asyncio.StreamReader()
        r.feed_data(struct.pack("<I", 1000) + b"x" * 10)
        return await _timed_read(r, timer, 0.3, 30.0)

    got, took = _in_task(idle_first, 0.3)
    assert got == "expired" and 0.25 <= took < 1.2


def test_read_timer_requests_in_time_are_served_and_never_cancelled_later():
    async def run(timer):
        r = asyncio.StreamReader()
        bodies = []
        for i in range(200):  # many reads, each well within its deadline
            r.feed_data(encode_frame(b"req%d" % i))
            got, _ = await _timed_read(r, timer, 0.2, 0.2)
            bodies.append(got)
        await asyncio.sleep(0.6)  # handling after a read (disarmed): never cancelled
        late = asyncio.get_running_loop().call_later(0.05, r.feed_data, encode_frame(b"late"))
        got, _ = await _timed_read(r, timer, 0.2, 0.2)
        late.cancel()
        return bodies, got, timer.expired

    bodies, got, expired = _in_task(run, 0.1)
    assert bodies == [b"req%d" % i for i in range(200)] and got == b"late" and not expired


def test_read_timer_catches_a_timer_that_keeps_its_first_deadline(monkeypatch):
    """Negative control: a timer that re-arms at the stored deadline only (not within its
    period) lets a frame begun under a long idle deadline stall that long; the scenario of
    the test above catches it."""

    def fire_late(self):
        self._handle = None
        at = self._at
        if at is None:
            return
        now = self._loop.time()
        if now < at:
            self._handle = self._loop.call_at(at, self._fire)  # the planted bug
            return
        self.expired = True
        self._task.cancel()

    monkeypatch.setattr(ReadTimer, "_fire", fire_late)

    async def bounded(timer):
        try:
            return await asyncio.wait_for(_begun_after_idling(timer), 2.0)
        except TimeoutError:
            return "still waiting after 2 s", None

    got, _ = _in_task(bounded, 0.3)
    assert got == "still waiting after 2 s"


def test_read_timer_refuses_a_bad_period():
    async def run():
        with pytest.raises(ValueError):
            ReadTimer(asyncio.current_task(), 0.0)

    asyncio.run(run())
