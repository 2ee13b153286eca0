"""The stall watchdog (kvmesh/net/stallwatch.py) on a real event loop: a planted stall is
reported with the frame that held the loop and the cyclic GC's share; a loop that never
stalls gives no report; ``KVMESH_STALL_TRACE_MS`` turns it on for ``eventloop.run``."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time

import pytest

from kvmesh.net import eventloop, stallwatch


def _planted_block(seconds: float) -> None:
    time.sleep(seconds)  # holds the loop: nothing else runs on it meanwhile


def _planted_gc(n: int) -> None:
    junk = [[i] for i in range(n)]  # many containers: a full pass has work to do
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.3:
        gc.collect()
    del junk


def _run(body, threshold_s: float = 0.05) -> stallwatch.StallWatch:
    loop = asyncio.new_event_loop()
    watch = stallwatch.StallWatch(loop, threading.get_ident(), threshold_s).start()

    async def main():
        await asyncio.sleep(0.1)
        body()
        await asyncio.sleep(0.2)  # the watch sees the loop back

    try:
        loop.run_until_complete(main())
    finally:
        watch.stop()
        loop.close()
    return watch


def test_a_stall_is_reported_with_the_frame_that_held_the_loop():
    watch = _run(lambda: _planted_block(0.4))
    assert len(watch.reports) == 1
    r = watch.reports[0]
    assert 0.3 <= r.seconds < 2.0
    assert r.samples >= 5 and "_planted_block" in r.stacks[0][0]
    assert "_planted_block" in r.format() and "held for" in r.format()


def test_a_loop_that_never_stalls_gives_no_report():
    watch = _run(lambda: None)
    assert not watch.reports


def test_the_cyclic_gc_share_of_a_stall_is_counted():
    watch = _run(lambda: _planted_gc(300_000))
    assert watch.reports
    r = max(watch.reports, key=lambda r: r.seconds)
    assert 2 in r.gc_passes and 0 < r.gc_s <= r.seconds + 0.05
    assert "cyclic GC" in r.format()


def test_the_environment_turns_it_on_for_every_server_loop(monkeypatch, caplog):
    async def main():
        await asyncio.sleep(0.1)
        _planted_block(0.3)
        await asyncio.sleep(0.2)

    monkeypatch.setenv(stallwatch.ENV, "50")
    with caplog.at_level(logging.WARNING, logger="kvmesh.stall"):
        eventloop.run(main())
    assert any("_planted_block" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.delenv(stallwatch.ENV)
    with caplog.at_level(logging.WARNING, logger="kvmesh.stall"):
        eventloop.run(main())
    assert not caplog.records


@pytest.mark.parametrize("bad", ["x", "0", "-5"])
def test_a_bad_threshold_is_refused(monkeypatch, bad):
    monkeypatch.setenv(stallwatch.ENV, bad)
    with pytest.raises(ValueError, match="stall|milliseconds"):
        eventloop.run(asyncio.sleep(0))
