"""``python -m tests.replog.bigframes TOKEN_FILE ADDR...``: one client that keeps ``DEPTH``
near-limit requests (a ReqRead of a KvGet whose key fills the client port's 4 MiB frame
limit) in flight on one connection until its stdin closes (at most ``MAX_S``), for the
fairness test of ``test_big_frames.py``. Prints the ``time.monotonic()`` of each answer, one a
line as it comes (the clock is the machine's, so the test can order them against its own
events), then ``done N``."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

from kvmesh.net import SecurityConfig
from kvmesh.replog.kvsm import KvGet, encode_command
from kvmesh.replog.net.client import KvClient
from kvmesh.replog.net.protocol import MAX_REQUEST

DEPTH = 4
# The frame: msgpack of ReqRead(rid, body) around encode_command(KvGet(key)); leave room for
# both headers.
KEY_BYTES = MAX_REQUEST - 256
MAX_S = 60.0  # bounded even if the test dies without closing our stdin


async def stream(addrs: list[str], security: SecurityConfig) -> int:
    body = encode_command(KvGet("k" * KEY_BYTES))
    done = 0
    end = time.monotonic() + MAX_S
    stop = threading.Event()
    # A daemon thread: a blocked read of stdin must not hold up the exit at MAX_S.
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    async with KvClient(addrs, security=security, timeout=30.0) as c:

        async def one() -> None:
            nonlocal done
            while not stop.is_set() and time.monotonic() < end:
                await c.read(body)
                done += 1
                print(time.monotonic(), flush=True)

        await asyncio.gather(*(one() for _ in range(DEPTH)))
    return done


if __name__ == "__main__":
    token_file, *addrs = sys.argv[1:]
    with open(token_file) as f:
        sec = SecurityConfig(token=f.read().strip())
    print(f"done {asyncio.run(stream(addrs, sec))}", flush=True)
