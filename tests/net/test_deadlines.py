"""kvmesh.net.deadlines: the one sweeper's idle and frame deadlines, and the time a server
itself stops reading a connection (its in-flight limit full) counting toward neither."""

from __future__ import annotations

import asyncio

from kvmesh.net import DeadlineWatch, FrameDecoder


class _Transport:
    def __init__(self) -> None:
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1


class _Writer:
    def __init__(self) -> None:
        self.transport = _Transport()


def _begun_frame(watch: DeadlineWatch):
    dec = FrameDecoder(1 << 20)
    assert dec.feed(b"\x10\x00") == [] and dec.buffered  # a length prefix cut short
    w = watch.watch(_Writer(), dec)  # type: ignore[arg-type]
    w.started = asyncio.get_running_loop().time()  # as read_frames marks a begun frame
    return w


def test_a_begun_frame_runs_out_of_time_unless_the_server_paused_the_reading():
    async def run() -> tuple[bool, bool, bool, bool]:
        loop = asyncio.get_running_loop()
        watch = DeadlineWatch(idle_s=30.0, frame_s=0.4)
        plain, held = _begun_frame(watch), _begun_frame(watch)
        held.pause()
        await asyncio.sleep(1.2)  # three frame deadlines: only the unpaused one expires
        plain_gone, held_gone = bool(plain.expired), bool(held.expired)
        held.resume()  # the 1.2 s held do not count; the frame has its 0.4 s again
        resumed = loop.time()
        await asyncio.sleep(0.05)
        # (A machine that stalled this loop past the new deadline cannot tell; count it.)
        still_there = not held.expired or loop.time() - resumed > 0.4
        end = loop.time() + 10  # then it does expire: a poll, not a fixed sleep
        while not held.expired and loop.time() < end:
            await asyncio.sleep(0.02)
        watch.stop()
        return plain_gone, held_gone, still_there, bool(held.expired)

    plain_gone, held_gone, still_there, later_gone = asyncio.run(run())
    assert plain_gone and not held_gone
    assert still_there and later_gone  # the pause shifted the deadline, never removed it
