"""The disk tier end to end (docs/store.md, "Disk tier"): a master, a ``kvmesh node`` with a
memory segment and a disk segment (real processes, a real file), and this process as the
client. Memory fills; the leader demotes the oldest objects; the node copies them to its
disk and ends the demotion; only then their memory goes. Every acknowledged object stays
readable byte-exact -- from disk once memory no longer holds it -- and a disk copy whose
file bytes were corrupted is refused per key (never wrong bytes) and dropped."""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import pytest

from kvmesh.replog.net.server import free_ports
from kvmesh.store import StoreClient
from kvmesh.store import errors as E

from .test_e2e_cli import _kvmesh, _line

MEM = 2 << 20
DISK = 32 << 20
SIZE = 64 << 10


@contextlib.contextmanager
def _cluster(tmp_path, *master_args: str):
    port, mport = free_ports(2)
    addr = f"127.0.0.1:{port}"
    m = _kvmesh(
        "master", "--listen", addr, "--dir", str(tmp_path / "m"), "--metrics-port", str(mport),
        "--ticker-s", "0.05", "--evict-ratio", "0.5", "--demote-timeout-s", "10", *master_args,
    )  # fmt: skip
    procs = [m]
    c = None
    try:
        _line(m, "READY")
        n = _kvmesh(
            "node", "--master", addr, "--size", str(MEM), "--heartbeat-s", "0.05",
            "--disk", str(tmp_path / "tier.seg"), "--disk-size", str(DISK),
        )  # fmt: skip
        procs.append(n)
        _line(n, "READY node")
        c = StoreClient(addr, timeout=10, segment_size=0)
        yield c, tmp_path / "tier.seg", addr
    finally:
        if c is not None:
            c.close()
        for p in reversed(procs):
            p.kill()
            p.wait(20)


@pytest.fixture
def tiered(tmp_path):
    with _cluster(tmp_path) as got:
        yield got


def _value(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


def _media(c: StoreClient) -> dict:
    return c.status()["media"]


def _settle(c: StoreClient, timeout: float = 20.0) -> dict:
    """Wait until memory is back under the eviction watermark (demotions done)."""
    end = time.monotonic() + timeout
    while True:
        st = c.status()
        mem = st["media"]["memory"]
        if mem["used"] < 0.9 * mem["capacity"] or time.monotonic() > end:
            return st
        time.sleep(0.05)


def _fill(c: StoreClient, keys: list[str], batch: int = 8) -> None:
    """Put ``keys`` in batches, each once memory has room again (the leader demotes in the
    background): pressure at the pace the tier keeps up with, so nothing is dropped."""
    for lo in range(0, len(keys), batch):
        part = keys[lo : lo + batch]
        res = c.put(part, [_value(int(k.split("-")[1])) for k in part])
        assert not any(isinstance(r, Exception) for r in res), res
        _settle(c)


def test_demoted_objects_are_read_byte_exact_from_disk_single_and_batch(tiered) -> None:
    c, _, _ = tiered
    keys = [f"obj-{i}" for i in range(96)]  # 6 MiB: three times the memory segment
    _fill(c, keys)
    st = _settle(c)
    media = st["media"]
    assert media["memory"]["used"] < MEM
    assert media["disk"]["used"] >= (len(keys) * SIZE - MEM)  # the rest went to disk
    assert st["requests"].get("demoted", 0) > 0 or media["disk"]["used"] > 0
    assert c.exists(keys) == [True] * len(keys)  # every acknowledged put is still there
    # a batch get mixing memory and disk copies: byte-exact
    got = c.get(keys)
    bad = [k for k, g in zip(keys, got) if g != _value(int(k.split("-")[1]))]
    assert bad == []
    # single gets of the oldest (disk-only) objects
    for k in keys[:4]:
        (g,) = c.get([k])
        assert g == _value(int(k.split("-")[1]))


def test_a_hicache_shaped_working_set_larger_than_memory_stays_found(tiered) -> None:
    """K and V objects of pages (HiCache's names: prefix + page hash + suffix), a working set
    4 x the memory segment: ``exists`` by parts (what ``batch_exists`` sends) still finds
    the early pages, and they read back byte-exact into a registered buffer."""
    c, _, _ = tiered
    pages = [f"{i:04x}" for i in range(64)]  # 64 pages x (K + V) x 64 KiB = 8 MiB
    names = [f"m-{int(p, 16) * 2 + j}" for p in pages for j in range(2)]
    _fill(c, names, batch=8)
    flags = c.exists([f"{int(p, 16) * 2}" for p in pages], prefix="m-", suffixes=[""])
    assert all(flags)
    early = names[:16]  # written first: demoted long ago
    buf = np.zeros(len(early) * SIZE, np.uint8)
    region = c.register_buffer(buf)
    got = c.get_into(early, region, [i * SIZE for i in range(len(early))])
    assert list(got) == [SIZE] * len(early)
    for i, k in enumerate(early):
        assert buf[i * SIZE : (i + 1) * SIZE].tobytes() == _value(int(k.split("-")[1]))


def test_a_corrupted_disk_copy_is_refused_per_key_and_dropped(tiered) -> None:
    c, path, _ = tiered
    keys = [f"obj-{i}" for i in range(48)]
    _fill(c, keys)
    _settle(c)
    # corrupt every byte of the file that holds data of the first object's disk copy: flip
    # the whole used part of the file except nothing else (simplest: flip it all)
    raw = bytearray(path.read_bytes()[: 4 << 20])
    with open(path, "r+b") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        f.write(bytes(b ^ 0xFF for b in raw))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    got = c.get(keys[:8])
    errs = [g for g in got if isinstance(g, Exception)]
    assert errs, "no corrupted read was detected"
    assert all(isinstance(g, E.InvalidRead) and "checksum" in str(g) for g in errs), got
    for k, g in zip(keys[:8], got):
        assert isinstance(g, Exception) or g == _value(int(k.split("-")[1]))  # never wrong bytes
    # the corrupt disk-only copies were dropped through the log: those keys are gone now
    bad = [k for k, g in zip(keys[:8], got) if isinstance(g, Exception)]
    assert c.exists(bad) == [False] * len(bad)


def test_readers_running_through_demotion_get_exact_bytes_or_a_per_key_miss(tiered) -> None:
    """Reader threads loop gets over the objects put so far while the writer pushes memory
    past its watermark again and again: every read is the exact bytes (from memory or,
    once demoted, from disk) -- a memory copy being read is never freed under its reader
    -- and, the writer being paced, no acknowledged object goes missing."""
    import random
    import threading

    c, _, addr = tiered
    readers = [StoreClient(addr, timeout=10, segment_size=0) for _ in range(2)]
    acked: list[str] = []
    bad: list[str] = []
    reads = [0]
    done = threading.Event()

    def loop(rc: StoreClient, seed: int) -> None:
        rng = random.Random(seed)
        while not done.is_set():
            if not acked:
                time.sleep(0.01)
                continue
            ks = rng.sample(acked, min(8, len(acked)))
            for k, g in zip(ks, rc.get(ks)):
                reads[0] += 1
                if isinstance(g, E.LeaseExpired):
                    continue  # a slow copy: reported, never other bytes
                if g != _value(int(k.split("-")[1])):
                    bad.append(f"{k}: {g!r}"[:200])

    threads = [threading.Thread(target=loop, args=(rc, i)) for i, rc in enumerate(readers)]
    for t in threads:
        t.start()
    try:
        keys = [f"obj-{i}" for i in range(96)]
        for lo in range(0, len(keys), 8):
            _fill(c, keys[lo : lo + 8])
            acked.extend(keys[lo : lo + 8])
    finally:
        done.set()
        for t in threads:
            t.join(30)
        for rc in readers:
            rc.close()
    assert bad == []
    assert reads[0] > 50
    assert _media(c)["disk"]["used"] > 0


def _wait_disk(c: StoreClient, state: str, timeout: float = 30.0) -> list[dict]:
    """The disk segments once one is ``state`` (the master's view)."""
    end = time.monotonic() + timeout
    while True:
        disks = [s for s in c.status()["segments"] if s.get("medium") == "disk"]
        if any(s["state"] == state for s in disks):
            return disks
        assert time.monotonic() < end, f"no {state} disk segment in time: {disks}"
        time.sleep(0.05)


def _node(addr: str, path) -> object:
    n = _kvmesh(
        "node", "--master", addr, "--size", str(MEM), "--heartbeat-s", "0.05",
        "--disk", str(path), "--disk-size", str(DISK),
    )  # fmt: skip
    _line(n, "READY node")
    return n


def test_a_node_restarted_on_its_disk_re_adopts_the_copies_and_drops_a_corrupted_one(tmp_path):
    """kill -9 of a node with disk-only objects; the master keeps its disk offline (copies
    listed, not found); the node restarted on the same path re-adopts them after a crc32c
    check: byte-exact reads, the one corrupted in the file before the restart dropped at
    adoption (a miss, never wrong bytes); with the id file wiped it adopts nothing."""
    port, mport = free_ports(2)
    addr = f"127.0.0.1:{port}"
    path = tmp_path / "tier.seg"
    procs = [
        _kvmesh(
            "master",
            "--listen",
            addr,
            "--dir",
            str(tmp_path / "m"),
            "--metrics-port",
            str(mport),
            "--ticker-s",
            "0.05",
            "--evict-ratio",
            "0.5",
            "--node-ttl-s",
            "1",
            "--node-suspect-s",
            "0.5",
        )  # fmt: skip
    ]
    c = None
    try:
        _line(procs[0], "READY")
        procs.append(_node(addr, path))
        c = StoreClient(addr, timeout=10, segment_size=0)
        keys = [f"obj-{i}" for i in range(48)]
        for lo in range(0, len(keys), 8):
            part = keys[lo : lo + 8]
            res = c.put(part, [_value(int(k.split("-")[1])) for k in part])
            assert not any(isinstance(r, Exception) for r in res), res
            _settle(c)
        reps = c.replicas(keys)
        only = {
            k: r[0].slices
            for k, r in zip(keys, reps)
            if not isinstance(r, Exception)
            and all(d.segment.endswith(".disk") for d in r[0].slices)
        }
        assert len(only) >= 8, f"only {len(only)} disk-only objects"
        assert os.path.exists(f"{path}.kvmesh-id")
        procs[1].kill()
        procs[1].wait(20)
        _wait_disk(c, "offline")
        disk_only = sorted(only)
        assert c.exists(disk_only) == [False] * len(disk_only)  # listed, but unreadable
        victim = disk_only[0]
        (sl,) = only[victim]
        with open(path, "r+b") as f:  # one object's bytes changed while the node was down
            f.seek(sl.offset + 100)
            f.write(b"\xa5" * 64)
            f.flush()
            os.fsync(f.fileno())
        procs.append(_node(addr, path))
        disks = _wait_disk(c, "mounted")
        assert [s["state"] for s in disks] == ["mounted"]
        # dropped at adoption, before any read could find it
        assert c.exists(disk_only) == [k != victim for k in disk_only]
        got = c.get(disk_only)
        assert isinstance(got[0], E.ObjectNotFound), got[0]
        for k, g in zip(disk_only[1:], got[1:]):
            assert g == _value(int(k.split("-")[1])), k
        # a wiped id file: the restarted node's disk adopts nothing
        procs[2].kill()
        procs[2].wait(20)
        _wait_disk(c, "offline")
        os.unlink(f"{path}.kvmesh-id")
        procs.append(_node(addr, path))
        disks = _wait_disk(c, "mounted")
        assert sorted(s["state"] for s in disks) == ["mounted", "offline"]
        assert [s["used"] for s in disks if s["state"] == "mounted"] == [0]
        assert c.exists(disk_only) == [False] * len(disk_only)
        assert all(isinstance(g, E.ObjectNotFound) for g in c.get(disk_only[1:]))
    finally:
        if c is not None:
            c.close()
        for p in reversed(procs):
            p.kill()
            p.wait(20)


def _on_disk_only(c: StoreClient, key: str) -> bool:
    (reps,) = c.replicas([key])
    return all(d.segment.endswith(".disk") for r in reps for d in r.slices)


def test_a_demoted_object_read_n_times_is_promoted_back_to_memory(tmp_path) -> None:
    """Promotion on hit (``--promote-hits 3``): a disk-only object read three times gets a
    memory copy again -- the node reads its disk copy into memory the master reserved,
    checks the crc and ends it through the log -- and is then served from memory,
    byte-exact, its disk copy kept; an object read less often stays on disk only."""
    with _cluster(tmp_path, "--promote-hits", "3") as (c, _, _):
        keys = [f"obj-{i}" for i in range(96)]  # 3 x memory
        _fill(c, keys)
        _settle(c)
        hot, cold = keys[:2], keys[2]
        assert _on_disk_only(c, hot[0]) and _on_disk_only(c, hot[1])
        c.remove(keys[48:])  # room in memory (promotion fills free memory only)
        for _ in range(3):
            got = c.get(hot)
            assert got == [_value(int(k.split("-")[1])) for k in hot]
        assert "tcp" in c.last_transports  # served by the owner from its file so far
        end = time.monotonic() + 20
        while any(_on_disk_only(c, k) for k in hot) and time.monotonic() < end:
            time.sleep(0.05)
        for k in hot:
            (reps,) = c.replicas([k])
            segs = [d.segment for r in reps for d in r.slices]
            assert len(segs) == 2 and not segs[0].endswith(".disk"), segs  # memory first
            assert segs[1].endswith(".disk")  # the disk copy kept
        got = c.get(hot)
        assert got == [_value(int(k.split("-")[1])) for k in hot]
        assert c.last_transports == ["shm"], c.last_transports  # from memory now
        assert _on_disk_only(c, cold)  # read once (plus this lookup): still on disk only


def test_write_through_puts_get_a_disk_copy_with_memory_kept(tmp_path) -> None:
    """``--write-through``: objects far under any watermark still get a disk copy soon after
    their put (the node writes it, checks nothing more), their memory kept: reads come
    from memory, byte-exact, and the disk copy holds the same bytes (its crc is checked on
    every read)."""
    with _cluster(tmp_path, "--write-through") as (c, _, _):
        keys = [f"obj-{i}" for i in range(4)]  # 256 KiB of a 2 MiB memory
        assert c.put(keys, [_value(i) for i in range(4)]) == [None] * 4
        # (no lookup before the copies are allocated: a read lease defers a demotion)
        end = time.monotonic() + 20
        while _media(c)["disk"]["used"] < 4 * SIZE and time.monotonic() < end:
            time.sleep(0.05)
        end = time.monotonic() + 20
        while True:  # then COMPLETE: lookups return the disk copies
            segs = [[d.segment for r in reps for d in r.slices] for reps in c.replicas(keys)]
            if all(len(s) == 2 for s in segs) or time.monotonic() > end:
                break
            time.sleep(0.05)
        assert len(segs) == 4 and all(len(s) == 2 and s[1].endswith(".disk") for s in segs), (
            segs
        )  # memory first
        mem = _media(c)["memory"]
        assert mem["used"] - mem["reserved_bytes"] == 4 * SIZE  # nothing freed
        assert c.get(keys) == [_value(i) for i in range(4)]
        assert c.last_transports == ["shm"]
