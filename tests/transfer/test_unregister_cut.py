"""A TCP-path writer cut off by the owner's ``unregister`` gets SegmentNotFound (issue 16,
part 5): docs/transfer.md promises it; the writer used to get PeerDeadError from the broken
pipe, as if the owner had died."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvmesh.transfer import EngineConfig, PeerDeadError, SegmentNotFound, TransferEngine
from kvmesh.transfer.transports import tcp

from .util import Peer

MiB = 1 << 20


@pytest.mark.parametrize("path", ["write", "pipelined"])
def test_a_writer_cut_off_by_unregister_gets_segment_not_found(path):
    size = 32 * MiB
    with Peer("--size", str(size)) as owner:
        eng = TransferEngine(config=EngineConfig(transport="tcp", host_id="cut-writer"))
        try:
            seg = eng.open_segment(owner.address, "pool")
            peer = eng.peer(owner.address)
            payload = np.full(size, 7, np.uint8)
            half = size // 2
            done: dict[str, object] = {}

            def unregister() -> None:
                done["res"] = owner.cmd("unregister", wait=10)

            def send(sock, head) -> None:
                # Stall mid-payload (the owner is inside recv_into the segment), let the owner
                # unregister it, then go on: the rest meets the connection it cut.
                sock.sendall(head)
                sock.sendall(memoryview(payload)[:half])
                t = threading.Thread(target=unregister)
                t.start()
                t.join(20)
                sock.sendall(memoryview(payload)[half:])

            off = np.array([0], "<u8")
            ln = np.array([size], "<u8")
            with pytest.raises(SegmentNotFound) as info:
                if path == "write":
                    tcp.client_write(peer, seg.desc, off, ln, size, 20.0, send)
                else:  # the same cut on execute_writes' connection
                    orig = tcp.send_ranges
                    tcp.send_ranges = lambda sock, base, lo, ln_, head: send(sock, head)
                    try:
                        region = eng.register(payload)
                        eng.transfer(tcp.Op.WRITE, region, np.array([0]), seg, np.array([0]), size)
                    finally:
                        tcp.send_ranges = orig
            assert not isinstance(info.value, PeerDeadError)
            assert done["res"]["ok"], done
            # The owner is alive: a ping still answers.
            peer.ping(5.0)
        finally:
            eng.close()
