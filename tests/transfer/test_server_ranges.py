"""The control server's range check (kvmesh.transfer.ranges) against a live peer process.

A client that skips its own engine's checks (``PeerClient.write``/``read`` send the request
as given) asks a live owner for ranges outside its segment: the owner refuses each with the
proper error, moves no byte, and keeps serving the same connection pool.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.transfer import InvalidLength, OutOfBounds
from kvmesh.transfer.transports import tcp

from .util import pattern, sha

SIZE = 1 << 20


def _u(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.uint64)


@pytest.mark.parametrize(
    "offsets, lengths, exc",
    [
        (_u(SIZE - 10), _u(20), OutOfBounds),  # past the end
        (_u(2**64 - 10), _u(20), OutOfBounds),  # offset + length wraps around to 10
        (_u(10), _u(2**64 - 5), OutOfBounds),  # the length alone wraps
        (_u(*range(0, 20 * 64, 64), SIZE), _u(*[8] * 20, 8), OutOfBounds),  # numpy path
        (_u(0, 64), _u(8, 0), InvalidLength),  # a zero-length piece
        (_u(0, 64), _u(8), InvalidLength),  # counts differ
    ],
)
def test_owner_refuses_bad_ranges(make_engine, make_peer, offsets, lengths, exc):
    peer = make_peer("--size", str(SIZE))
    eng = make_engine(transport="tcp")
    seg = eng.open_segment(peer.address, "pool")
    client = eng.peer(peer.address)
    before = peer.cmd("sha", offset=0, length=SIZE)["sha"]
    n = min(int(lengths.sum()) if len(lengths) and int(lengths.max()) < SIZE else 64, 4096)
    payload = np.full(n, 0xEE, np.uint8)
    with pytest.raises(exc):
        tcp.write_views(client, seg.desc, offsets, lengths, [memoryview(payload)], n, 10.0)
    with pytest.raises(exc):
        tcp.read_views(client, seg.desc, offsets, lengths, [memoryview(payload)], n, 10.0)
    assert peer.cmd("sha", offset=0, length=SIZE)["sha"] == before  # not a byte landed
    # The same peer still serves good requests (the refused ones kept the stream in sync).
    local = eng.register(np.zeros(4096, np.uint8))
    eng.read(local, 0, seg, 4096, 4096)
    assert sha(local.array()) == sha(pattern(1, 4096, 4096))
