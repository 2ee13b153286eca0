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
    assert time.monotonic() - t0 < 3.0  # the 0.2 s deadline, slack for a loaded machine
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
        assert time.monotonic() - t0 < 3.0  # slack for a loaded machine
        idle = asyncio.StreamReader()  # no prefix yet: frame_timeout does not apply
        with pytest.raises(TimeoutError) as ei:
            await asyncio.wait_for(aread_frame(idle, 100, frame_timeout=0.05), 0.3)
        assert not isinstance(ei.value, DeadlineExceeded)  # the caller's idle bound fired
        ok = asyncio.StreamReader()
        ok.feed_data(encode_frame(b"fine"))
        assert await aread_frame(ok, 100, frame_timeout=0.2) == b"fine"

    asyncio.run(main())
