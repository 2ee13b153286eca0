"""``python -m tests.replog.bigframes TOKEN_FILE SECONDS ADDR...``: one client that keeps
``DEPTH`` near-limit requests (a ReqRead of a KvGet whose key fills the client port's 4 MiB
frame limit) in flight on one connection for ``SECONDS``, for the fairness test of
``test_big_frames.py``. Prints the number of requests answered. Bounded in time."""

from __future__ import annotations

import asyncio
import sys
import time

from kvmesh.net import SecurityConfig
from kvmesh.replog.kvsm import KvGet, encode_command
from kvmesh.replog.net.client import KvClient
from kvmesh.replog.net.protocol import MAX_REQUEST

DEPTH = 4
# The frame: msgpack of ReqRead(rid, body) around encode_command(KvGet(key)); leave room for
# both headers.
KEY_BYTES = MAX_REQUEST - 256


async def stream(addrs: list[str], security: SecurityConfig, seconds: float) -> int:
    body = encode_command(KvGet("k" * KEY_BYTES))
    done = 0
    end = time.monotonic() + seconds
    async with KvClient(addrs, security=security, timeout=30.0) as c:

        async def one() -> None:
            nonlocal done
            while time.monotonic() < end:
                await c.read(body)
                done += 1

        await asyncio.gather(*(one() for _ in range(DEPTH)))
    return done


if __name__ == "__main__":
    token_file, seconds, *addrs = sys.argv[1:]
    with open(token_file) as f:
        sec = SecurityConfig(token=f.read().strip())
    print(asyncio.run(stream(addrs, sec, float(seconds))), flush=True)
