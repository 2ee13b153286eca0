"""Eviction racing live readers, end to end: a writer process fills the pool far past its
capacity (so eviction runs all the time) while reader threads here loop ``get`` and
``get_into`` over a working set and over the newest objects. Every read is the exact bytes
or a per-key miss (ObjectNotFound / LeaseExpired): never other bytes, never a whole-batch
failure; and an object a reader holds a lease on is never evicted under it (it still exists
while the lease lasts: the writer only adds keys, so only eviction could take it).

The planted control runs the same with a master whose eviction ignores read leases (a
``sitecustomize`` in the master's path wraps ``choose_victims``): the lease check catches it.
"""

from __future__ import annotations

import collections
import os
import random
import threading
import time

import numpy as np

from kvmesh.store import StoreClient
from kvmesh.store import errors as E
from kvmesh.store.cluster import StoreCluster

from .e2e_util import TOKEN, Peer
from .store_peer import value_of

LEASE_S = 1.0
SEGMENT = 8 << 20
SIZE = 64 << 10
# 5 MiB of the 8 MiB pool, read all the time (so mostly under lease): once the older fill
# objects are gone, a put finds only leased objects to evict (and gets NoSpace) -- unless
# eviction ignores leases
WORKING = [f"ws-{i}" for i in range(80)]
FILL_BATCHES = 48  # x 16 x 64 KiB = 48 MiB written: 6x the pool
RUN_S = 6.0

_PLANT = """
import kvmesh.store.master.eviction as ev
from kvmesh.store.master.leases import LeaseTable
_orig = ev.choose_victims
def _ignoring_leases(sm, leases, *a, **k):
    return _orig(sm, LeaseTable(), *a, **k)
ev.choose_victims = _ignoring_leases
"""


def _run(tmp_path, plant: bool, min_s: float = 2.0) -> dict:
    env = {}
    if plant:
        d = tmp_path / "plant"
        d.mkdir()
        (d / "sitecustomize.py").write_text(_PLANT)
        env["PYTHONPATH"] = f"{d}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # StoreCluster's children inherit this environment
    try:
        cl = StoreCluster(
            str(tmp_path / "m"), 1, token=TOKEN, durability="memory",
            extra_args=["--lease-ttl-s", str(LEASE_S)],
        )  # fmt: skip
        cl.start_all()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    writer = Peer(cl.address, SEGMENT)  # the storage node and the writer
    reader = StoreClient(cl.address, token=TOKEN, timeout=10, segment_size=0)
    stats = {"bytes_ok": 0, "miss": 0, "lease_expired": 0, "leased_gone": [], "bad": []}
    lock = threading.Lock()
    newest: list[str] = []
    done = threading.Event()
    reading = threading.Event()
    try:
        r = writer.call(op="put", keys=WORKING, sizes=[SIZE] * len(WORKING))
        assert r["codes"] == [0] * len(WORKING)

        def note(key: str, got, t0: float, held: collections.deque) -> None:
            """One per-key read result (bytes, bytes read, or an error)."""
            if isinstance(got, (E.ObjectNotFound, E.LeaseExpired)):
                with lock:
                    stats["miss" if isinstance(got, E.ObjectNotFound) else "lease_expired"] += 1
                return
            if isinstance(got, Exception):
                with lock:
                    stats["bad"].append(f"{key}: {got!r}")
                return
            with lock:
                stats["bytes_ok"] += 1
            held.append((t0, key))  # leased from (after) t0 for LEASE_S: checked below

        def check_leases(held: collections.deque) -> None:
            """Keys read 0.4..0.8 lease ago must still exist (only eviction removes keys
            here, and it must skip leased ones)."""
            now = time.monotonic()
            due = []
            while held and now - held[0][0] >= 0.4 * LEASE_S:
                due.append(held.popleft())
            due = [(t0, k) for t0, k in due if now < t0 + 0.8 * LEASE_S]
            if not due:
                return
            present = reader.exists([k for _, k in due])
            after = time.monotonic()
            for (t0, k), p in zip(due, present):
                if p is not True and after < t0 + 0.8 * LEASE_S:
                    with lock:
                        stats["leased_gone"].append(k)

        def read_loop(seed: int) -> None:
            rng = random.Random(seed)
            buf = np.zeros(8 * SIZE, dtype=np.uint8)
            reader.register_buffer(buf)
            held: collections.deque = collections.deque()
            try:
                while not done.is_set():
                    reading.set()
                    check_leases(held)
                    with lock:
                        recent = newest[-32:]
                    keys = rng.sample(WORKING, 6) + rng.sample(recent, min(2, len(recent)))
                    keys += rng.sample(WORKING, 8 - len(keys))
                    t0 = time.monotonic()
                    if rng.random() < 0.5:
                        res = reader.get(keys)
                        for k, got in zip(keys, res):
                            if isinstance(got, bytes) and got != value_of(k, SIZE):
                                with lock:
                                    stats["bad"].append(f"{k}: wrong bytes (get)")
                                continue
                            note(k, got, t0, held)
                    else:
                        buf[:] = 0
                        res = reader.get_into(keys, buf, [i * SIZE for i in range(8)], [SIZE] * 8)
                        for i, (k, got) in enumerate(zip(keys, res)):
                            if isinstance(got, int) and not isinstance(got, bool):
                                view = buf[i * SIZE : i * SIZE + got].tobytes()
                                if got != SIZE or view != value_of(k, SIZE):
                                    with lock:
                                        stats["bad"].append(f"{k}: wrong bytes (get_into)")
                                    continue
                            note(k, got, t0, held)
            except Exception as e:  # noqa: BLE001 - a whole-call failure is a finding
                with lock:
                    stats["bad"].append(f"reader {seed} raised {e!r}")
            finally:
                reader.unregister_buffer(buf)

        readers = [threading.Thread(target=read_loop, args=(s,)) for s in range(3)]
        for t in readers:
            t.start()
        reading.wait(10)  # the readers are under way before the pool fills
        t0 = time.monotonic()
        t_end = t0 + RUN_S
        b = 0
        # at least FILL_BATCHES batches and min_s seconds of eviction racing the readers
        while (b < FILL_BATCHES or time.monotonic() < t0 + min_s) and time.monotonic() < t_end:
            keys = [f"fill-{b}-{i}" for i in range(16)]
            r = writer.call(op="put", keys=keys, sizes=[SIZE] * 16)
            ok = [k for k, c in zip(keys, r["codes"]) if c == 0]
            with lock:
                newest.extend(ok)
            b += 1
        done.set()
        for t in readers:
            t.join(30)
        st = reader.status()
        stats["evicted"] = st["requests"].get("evicted", 0)
        stats["batches"] = b
        stats["usage"] = st["usage"]
        return stats
    finally:
        done.set()
        reader.close()
        writer.close()
        cl.close()


def test_eviction_racing_readers_never_gives_wrong_bytes_or_evicts_leased(tmp_path):
    s = _run(tmp_path, plant=False)
    assert s["evicted"] > 0 and s["batches"] * 16 * SIZE > 2 * SEGMENT, s  # it raced
    assert s["bytes_ok"] > 50, s
    assert not s["bad"], s["bad"][:5]
    assert not s["leased_gone"], s["leased_gone"][:5]
    assert s["usage"]["used"] <= s["usage"]["capacity"]


def test_planted_eviction_ignoring_leases_is_caught_end_to_end(tmp_path):
    s = _run(tmp_path, plant=True, min_s=3.0)
    assert s["leased_gone"] or s["bad"], s
