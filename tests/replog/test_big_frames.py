"""One client's near-limit frames must not starve another's small requests (issue 16, 5a).

A live 3-replica cluster. A client process keeps 4 MiB requests (the client port's frame
limit) in flight on one connection, and this process holds one more 4 MiB request half sent
on a connection to every replica. Small linearizable reads sent after that must all complete
while the held requests are still unfinished and while the big-frame client keeps being
answered: nothing waits for a big frame to arrive whole, nor queues behind the frames that
flow. The test asserts that order of events, never a latency or a ratio of latencies, so
neither CPU speed nor the machine's load can fail it (a read that waited for the held frames
would wait forever: the test ends them only after its reads). The held requests are then
finished and answered (they were real frames in progress, not dropped connections).

What it does not judge: how much a flowing 4 MiB frame's decode delays a small read on the
same event loop (milliseconds; a tail-latency figure that only a benchmark on a quiet
machine can measure; the reads' p50/p90 are printed for information).
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import threading
import time

from kvmesh.net import aclient_handshake, aread_frame, encode_frame
from kvmesh.replog.kvsm import KvGet, encode_command
from kvmesh.replog.net.protocol import (
    CLIENT_SERVICE,
    MAX_RESPONSE,
    ReqRead,
    decode_response,
    encode,
)
from kvmesh.replog.net.server import LocalCluster

from .bigframes import KEY_BYTES
from .test_hostile import TICK_MS, TOKEN, client, open_raw, run

# Small reads made while the frames are held: at least this many, and until the big-frame
# client has had this many answers since the hold began (events, not a time).
SMALL_READS = 100
BIG_ANSWERS = 4
# Within the server's frame deadline (ServerLimits.frame_timeout_s = 10 s), after which it
# would close the held connections; a read that is not answered in this time is starved.
HOLD_LIMIT_S = 8.0


class _Answers:
    """The big-frame client's answer times, read from its stdout as they come."""

    def __init__(self, p: subprocess.Popen) -> None:
        self.times: list[float] = []
        self.done: str | None = None
        self.first = threading.Event()
        self._t = threading.Thread(target=self._read, args=(p,), daemon=True)
        self._t.start()

    def _read(self, p: subprocess.Popen) -> None:
        for line in p.stdout:
            if line.startswith("done"):
                self.done = line.strip()
            else:
                self.times.append(float(line))
                self.first.set()

    def since(self, t: float) -> int:
        return sum(1 for x in list(self.times) if x > t)

    def join(self) -> None:
        self._t.join(30)


async def _hold(
    cluster, addr: str, rid: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A connection to ``addr`` with the first half of a 4 MiB ReqRead sent; returns the
    rest of the frame."""
    r, w = await open_raw(addr)
    await aclient_handshake(r, w, cluster.security, CLIENT_SERVICE, "held")
    frame = encode_frame(encode(ReqRead(rid, encode_command(KvGet("h" * KEY_BYTES)))))
    half = len(frame) // 2
    w.write(frame[:half])
    await w.drain()
    return r, w, frame[half:]


def _p(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]


def test_big_frames_do_not_starve_small_requests(tmp_path):
    cluster = LocalCluster(str(tmp_path), 3, tick_ms=TICK_MS, election_ticks=10, token=TOKEN)
    p: subprocess.Popen | None = None
    try:
        cluster.start_all()
        p = subprocess.Popen(
            [sys.executable, "-m", "tests.replog.bigframes", cluster.token_file,
             *cluster.client_addrs.values()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        big = _Answers(p)

        async def main():
            lat: list[float] = []
            async with client(cluster, timeout=HOLD_LIMIT_S) as c:
                await c.put("small", b"v")
                # Hold only once the big frames flow (its first answer), not while it starts.
                assert await asyncio.to_thread(big.first.wait, 60), "no big frame answered"
                held = [await _hold(cluster, a, 7) for a in cluster.client_addrs.values()]
                t_hold = time.monotonic()
                end = t_hold + HOLD_LIMIT_S
                while len(lat) < SMALL_READS or big.since(t_hold) < BIG_ANSWERS:
                    assert time.monotonic() < end, (
                        f"{len(lat)} small reads and {big.since(t_hold)} big-frame answers in "
                        f"{HOLD_LIMIT_S} s while 4 MiB requests were held half sent"
                    )
                    t = time.monotonic()
                    assert await c.get("small") == b"v"
                    lat.append(time.monotonic() - t)
                # The held requests were still unfinished: end them, each must be answered.
                for _r, w, rest in held:
                    w.write(rest)
                for r, w, _ in held:
                    resp = decode_response(await asyncio.wait_for(aread_frame(r, MAX_RESPONSE), 30))
                    assert resp.rid == 7, resp
                    w.close()
                return lat, big.since(t_hold)

        lat, flowed = run(main(), timeout=120)
        p.stdin.close()
        assert p.wait(30) == 0, "the big-frame client failed"
        big.join()
        print(
            f"{len(lat)} small reads (p50 {_p(lat, 50) * 1e3:.2f} ms, p90 {_p(lat, 90) * 1e3:.2f}"
            f" ms) and {flowed} big-frame answers while 4 MiB requests were held; {big.done}"
        )
        assert big.done is not None and int(big.done.split()[1]) >= BIG_ANSWERS
    finally:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(10)
        cluster.close()
