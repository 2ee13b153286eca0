"""The master-wide object-count cap (``--max-objects``) on a live master: eviction starts
at the high watermark of the count as it does for bytes, and new keys that cannot fit
answer NoSpace per key instead of growing the master; ``kvmesh status`` reports objects,
bytes per object and the master's RSS."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvmesh.store import StoreClient
from kvmesh.store import errors as E
from kvmesh.store.cluster import StoreCluster
from kvmesh.store.types import ReplicateConfig

from .e2e_util import TOKEN

CAP = 100
NO_SPACE = int(E.NoSpace.code)


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _vals(keys: list[str]) -> list[bytes]:
    return [k.encode() * 64 for k in keys]


def test_object_cap_evicts_then_refuses_per_key(tmp_path):
    with StoreCluster(
        str(tmp_path),
        1,
        token=TOKEN,
        durability="memory",
        extra_args=["--max-objects", str(CAP)],
    ) as cl:
        cl.start_all()
        c = StoreClient(cl.address, token=TOKEN, segment_size=16 << 20, timeout=20)
        try:
            # Below the watermark (90 of 100) nothing is evicted.
            a = [f"a{i}" for i in range(80)]
            assert list(c.put(a, _vals(a)).codes) == [0] * 80
            assert c.status()["objects"] == 80
            # 40 new keys with room for 20: the put evicts first, every key is placed,
            # the count never passes the cap; then the ticker brings it back to 85 %.
            b = [f"b{i}" for i in range(40)]
            assert list(c.put(b, _vals(b)).codes) == [0] * 40
            assert c.status()["objects"] <= CAP
            _wait(lambda: c.status()["objects"] <= 85, 20, "eviction down to 85 objects")
            assert all(c.exists(b))  # the oldest went first
            # Hard-pinned objects cannot be evicted: fill to the cap, then the new keys of
            # a put answer NoSpace one by one while the existing ones keep their own code.
            c.remove_all(force=True)
            pin = ReplicateConfig(replica_num=1, hard_pin=True)
            p = [f"p{i}" for i in range(CAP)]
            assert list(c.put(p, _vals(p), config=pin).codes) == [0] * CAP
            more = ["p0", "x0", "x1", "x2"]
            codes = list(c.put(more, _vals(more), config=pin).codes)
            assert codes == [int(E.ObjectExists.code), NO_SPACE, NO_SPACE, NO_SPACE], codes
            assert c.status()["objects"] == CAP
            assert list(c.exists(["x0", "x1", "x2"])) == [False, False, False]
            # Room again after a remove: the same keys go in.
            c.remove(["p1", "p2"], force=True)
            x = ["x0", "x1", "x2"]
            codes = list(c.put(x, _vals(x), config=pin).codes)
            assert codes == [0, 0, NO_SPACE], codes
            st = c.status()
            assert st["objects"] == CAP and st["max_objects"] == CAP
            assert st["rss_bytes"] > 1 << 20 and st["rss_per_object"] == st["rss_bytes"] // CAP
            env = dict(os.environ, KVMESH_TOKEN=TOKEN)
            out = subprocess.run(
                [sys.executable, "-m", "kvmesh.cli", "status", "--master", cl.address],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
            ).stdout
            assert f"objects {CAP} of at most {CAP} (100.0%)" in out, out
            assert "bytes of data per object" in out and "master RSS" in out, out
            assert "bytes per object)" in out, out
        finally:
            c.close()
