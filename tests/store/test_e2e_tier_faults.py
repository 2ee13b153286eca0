"""Faults of the disk tier end to end (docs/store.md, "Disk tier"; issue 19's failure tests),
with real ``kvmesh master`` / ``kvmesh node --disk`` processes and real files, this process
(and child processes) as clients:

* kill -9 of the node holding the disk while demotions are in flight: after its restart no
  listed disk copy holds other bytes than its object (checked in the file itself), and every
  acknowledged put is still read byte-exact, except objects whose only copy was in the
  killed node's memory;
* kill -9 of a reader in the middle of disk reads: its leases end, the node's connection to
  it is closed, the other readers go on reading exact bytes;
* a disk whose writes fail: demotion fails cleanly (no disk copy ever listed, memory copies
  kept, the node says why); a full disk tier: objects that do not fit are evicted as
  without the tier, never corrupted; a disk path that is not writable or larger than its
  filesystem's free space stops the node at start with the reason;
* two nodes, the disk on one of them: demotions whose memory copy is on the other node (the
  staging copy), disk-only reads over a forced network path (single and batch), and the
  per-key medium and transport a batch get reports.

Nothing here depends on speed: waits poll the master's state under generous deadlines."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from kvmesh.replog.net.server import free_ports
from kvmesh.store import StoreClient
from kvmesh.store import errors as E
from kvmesh.transfer import EngineConfig, TransferEngine

from .test_e2e_cli import _kvmesh, _line
from .test_e2e_tiers import DISK, MEM, SIZE, _settle, _value, _wait_disk

ENV = {k: v for k, v in os.environ.items() if k != "KVMESH_TOKEN"}


def _master(tmp_path, addr: str, *extra: str) -> subprocess.Popen:
    (mport,) = free_ports(1)
    m = _kvmesh(
        "master", "--listen", addr, "--dir", str(tmp_path / "m"), "--metrics-port", str(mport),
        "--ticker-s", "0.05", "--evict-ratio", "0.5", *extra,
    )  # fmt: skip
    _line(m, "READY")
    return m


def _node(addr: str, *extra: str, size: int = MEM, **kw) -> subprocess.Popen:
    n = _kvmesh(
        "node", "--master", addr, "--size", str(size), "--heartbeat-s", "0.05", *extra, **kw
    )
    _line(n, "READY node")
    return n


def _disk_args(path, size: int = DISK) -> tuple[str, ...]:
    return ("--disk", str(path), "--disk-size", str(size))


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        p.kill()
        p.wait(20)


def _idx(k: str) -> int:
    return int(k.split("-")[1])


def _put(c: StoreClient, keys: list[str]) -> None:
    res = c.put(keys, [_value(_idx(k)) for k in keys])
    assert not any(isinstance(r, Exception) for r in res), res


def _copies(c: StoreClient, keys: list[str]) -> dict[str, list]:
    """Per key the listed copies (each a list of slices); a key not found: absent."""
    out = {}
    for k, r in zip(keys, c.replicas(keys)):
        if not isinstance(r, Exception):
            out[k] = [d.slices for d in r]
    return out


def _on_disk(copy) -> bool:
    return all(s.segment.endswith(".disk") for s in copy)


def _file_bytes(path, copy) -> bytes:
    """A disk copy's bytes as the file holds them (not through any client check)."""
    with open(path, "rb") as f:
        return b"".join(os.pread(f.fileno(), s.length, s.offset) for s in copy)


def _disk_name(c: StoreClient) -> str:
    (name,) = [s["name"] for s in c.status()["segments"] if s["medium"] == "disk"]
    return name


def _disk_node_memory(c: StoreClient) -> str:
    """The memory segment of the node whose disk segment is mounted."""
    segs = c.status()["segments"]
    (node,) = [s["node_id"] for s in segs if s["medium"] == "disk" and s["state"] == "mounted"]
    (name,) = [s["name"] for s in segs if s["medium"] == "memory" and s["node_id"] == node
               and s["state"] == "mounted"]  # fmt: skip
    return name


def _until(what, timeout: float = 30.0, step: float = 0.05, msg: str = ""):
    end = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < end, f"not in time: {msg or what}"
        time.sleep(step)


# ------------------------------------------------------------------ kill -9 mid-demotion


def test_kill9_of_the_disk_node_mid_demotion_leaves_no_wrong_copy_and_loses_no_ack(tmp_path):
    """Two nodes: A (memory only) and B (memory and the disk). Objects fill memory past the
    demotion watermark, then B is killed with SIGKILL, twice: right when the master started
    a new demotion batch (disk bytes allocated: PROCESSING copies), and right when it
    applied the ``DemoteEnd`` of a new batch (COMPLETE copies, memory copies maybe freed,
    the next batch maybe in flight). After each restart on the same file: every disk copy
    the master lists holds its object's bytes in the file itself; every acknowledged object
    reads byte-exact, except those whose every copy was in B's memory at the kill (gone
    with B's process, as without a tier); no read is an InvalidRead."""
    (port,) = free_ports(1)
    addr = f"127.0.0.1:{port}"
    path = tmp_path / "tier.seg"
    # the master's view is read right after the kill, well before B is expired
    ttl = ("--node-ttl-s", "2", "--node-suspect-s", "1")
    procs = [_master(tmp_path, addr, *ttl)]
    c = None
    try:
        procs.append(_node(addr))  # A
        procs.append(_node(addr, *_disk_args(path)))  # B
        c = StoreClient(addr, timeout=10, segment_size=0)
        keys = [f"obj-{i}" for i in range(224)]
        acked: list[str] = []
        # 2 x memory, paced, so that many objects are on disk only.
        for lo in range(0, 64, 8):
            _put(c, keys[lo : lo + 8])
            acked += keys[lo : lo + 8]
            _settle(c)
        lo = 64
        for trigger in ("started", "ended"):
            b_mem = _disk_node_memory(c)

            def mark(st: dict, trigger=trigger) -> int:
                if trigger == "started":
                    return st["media"]["disk"]["used"]
                return st["requests"].get("DemoteEndReq", 0)

            mark0 = mark(c.status())
            hit = False
            while not hit and lo < len(keys):  # puts until the trigger, then kill at once
                _put(c, keys[lo : lo + 8])
                acked += keys[lo : lo + 8]
                lo += 8
                end = time.monotonic() + 5
                while not hit and time.monotonic() < end:
                    hit = mark(c.status()) > mark0
                if not hit:
                    _settle(c)  # room again before the next puts
            procs[-1].kill()
            procs[-1].wait(20)
            assert hit, f"no demotion batch {trigger}"
            before = _copies(c, acked)  # the master's view at the kill: B not expired yet
            if set(before) != set(acked):  # only eviction (a put that found no room) may
                assert c.status()["requests"].get("evicted", 0) > 0, set(acked) - set(before)
                acked = [k for k in acked if k in before]
            only_b = {
                k for k, cs in before.items()
                if all(not _on_disk(cp) and all(s.segment == b_mem for s in cp) for cp in cs)
            }  # fmt: skip
            _wait_disk(c, "offline")
            procs.append(_node(addr, *_disk_args(path)))
            _wait_disk(c, "mounted")
            after = _copies(c, acked)
            wrong = [
                k for k, cs in after.items() for cp in cs
                if _on_disk(cp) and _file_bytes(path, cp) != _value(_idx(k))
            ]  # fmt: skip
            assert wrong == [], f"{trigger}: listed disk copies with other bytes: {wrong[:8]}"
            got = c.get(acked)
            lost, bad = [], []
            for k, g in zip(acked, got):
                if isinstance(g, E.ObjectNotFound):
                    lost.append(k)
                elif g != _value(_idx(k)):
                    bad.append(f"{k}: {g!r}"[:120])
            assert bad == [], (trigger, bad[:8])
            gone = sorted(set(lost) - only_b)
            assert gone == [], f"{trigger}: acknowledged and lost: {gone[:8]}"
            assert any(_on_disk(cp) for cs in after.values() for cp in cs)  # re-adopted
            acked = [k for k in acked if k not in set(lost)]
    finally:
        if c is not None:
            c.close()
        _stop(procs)


# ------------------------------------------------------------------ kill -9 mid-read

_READER = textwrap.dedent(
    """
    import sys
    from kvmesh.store import StoreClient
    c = StoreClient(sys.argv[1], timeout=10, segment_size=0)
    keys = sys.argv[2].split(",")
    n = 0
    while True:
        got = c.get(keys)
        n += 1
        print("READ", n, sum(isinstance(g, bytes) for g in got), flush=True)
    """
)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_kill9_of_a_reader_mid_read_of_disk_only_objects_leaks_nothing(tiered_faults):
    """Reader processes loop batch gets of disk-only objects (served by the node reading its
    file and pushing over TCP); one is killed with SIGKILL while reading. Its leases end
    (the master's lease count drops back to none), the node closes what it held for it
    (its descriptors back to what they were before the readers), and a reader in this
    process keeps reading exact bytes throughout and after."""
    c, _path, addr, node = tiered_faults
    keys = [f"obj-{i}" for i in range(64)]
    for lo in range(0, len(keys), 8):
        _put(c, keys[lo : lo + 8])
        _settle(c)
    copies = _copies(c, keys)
    disk_only = [k for k, cs in copies.items() if all(_on_disk(cp) for cp in cs)][:16]
    assert len(disk_only) >= 8, len(disk_only)
    bad: list[str] = []
    reads = [0]
    stop = threading.Event()

    def mine() -> None:
        while not stop.is_set():
            for k, g in zip(disk_only, c.get(disk_only)):
                reads[0] += 1
                if g != _value(_idx(k)):
                    bad.append(f"{k}: {g!r}"[:120])

    t = threading.Thread(target=mine, daemon=True)
    t.start()
    # the node's descriptors once this process's reader has its connections
    _until(lambda: reads[0] >= 4 * len(disk_only))
    base = _fds(node.pid)
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", _READER, addr, ",".join(disk_only)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=ENV,
        )  # fmt: skip
        for _ in range(2)
    ]
    try:
        for r in readers:
            assert _line(r, "READ").split()[2] == str(len(disk_only))
        # kill one in the middle of its reads (it is looping gets without pause)
        for _ in range(3):
            _line(readers[0], "READ")
        readers[0].send_signal(signal.SIGKILL)
        readers[0].wait(20)
        n0 = reads[0]
        for _ in range(3):  # the other reader process is unaffected
            line = _line(readers[1], "READ")
            assert line.split()[2] == str(len(disk_only)), line
        readers[1].kill()
        readers[1].wait(20)
        _until(lambda: reads[0] > n0 + len(disk_only))
    finally:
        stop.set()
        t.join(30)
        for r in readers:
            r.kill()
            r.wait(20)
    assert bad == [], bad[:8]
    # the killed readers' leases end (by their deadline) and nothing stays leased
    _until(lambda: c.status()["leases"] == 0, msg="leases still held")
    # the node closed its connections to the dead readers
    _until(lambda: _fds(node.pid) <= base, msg=f"the node holds more than {base} descriptors")
    got = c.get(disk_only)
    assert [g == _value(_idx(k)) for k, g in zip(disk_only, got)] == [True] * len(disk_only)


@pytest.fixture
def tiered_faults(tmp_path):
    """The tiered cluster of test_e2e_tiers, also handing out the node's process."""
    (port,) = free_ports(1)
    addr = f"127.0.0.1:{port}"
    path = tmp_path / "tier.seg"
    procs = [_master(tmp_path, addr, "--demote-timeout-s", "10")]
    c = None
    try:
        procs.append(_node(addr, *_disk_args(path)))
        c = StoreClient(addr, timeout=10, segment_size=0)
        yield c, path, addr, procs[1]
    finally:
        if c is not None:
            c.close()
        _stop(procs)


# ------------------------------------------------------------------ disk faults


def test_a_disk_path_not_writable_or_larger_than_its_filesystem_stops_the_node(tmp_path):
    """No master needed: the disk is checked before anything is mounted. Exit status 2 and
    one line saying why, no traceback."""
    ro = tmp_path / "ro"
    ro.mkdir()
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    cases = [
        ([], str(tmp_path / "missing-dir" / "seg"), "1MiB", "not usable"),
        ([], str(tmp_path / "big.seg"), str(free + (64 << 30)), "bytes free"),
    ]
    if os.geteuid() != 0:  # permissions stop everyone but root
        ro.chmod(0o500)
        cases.append(([], str(ro / "seg"), "1MiB", "not writable"))
    try:  # a read-only filesystem stops root too
        cases.append((_small_fs(ro, "ro,size=1m"), str(ro / "seg"), "64KiB", "not writable"))
    except pytest.skip.Exception:
        pass
    for pre, bad, size, why in cases:
        p = subprocess.run(
            [*pre, sys.executable, "-m", "kvmesh.cli", "node", "--master", "127.0.0.1:9"]
            + ["--disk", bad, "--disk-size", size],
            capture_output=True, text=True, timeout=60, env=ENV,
        )  # fmt: skip
        assert p.returncode == 2, (bad, p.returncode, p.stderr)
        assert "kvmesh node: error: disk path" in p.stderr and why in p.stderr, (bad, p.stderr)
        assert "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "big.seg").exists() or os.stat(tmp_path / "big.seg").st_blocks == 0


def _small_fs(mnt, opts: str) -> list[str]:
    """A command prefix running its command in a mount namespace of its own where ``mnt`` is
    a tmpfs mounted with ``opts`` (a small or read-only filesystem without touching the
    host's mounts); the test is skipped where mount namespaces are not permitted."""
    os.makedirs(mnt, exist_ok=True)
    pre = ["unshare", "-m", "--propagation", "private", "sh", "-c",
           f'mount -t tmpfs -o {opts} tmpfs "$0" && exec "$@"', str(mnt)]  # fmt: skip
    try:
        ok = subprocess.run([*pre, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.skip("mount namespaces (unshare -m, mount) are not permitted here")
    return pre


def _fill_fs(root) -> str:
    """Fill the filesystem at ``root`` with one file; returns its path."""
    f = os.path.join(root, "filler")
    fd = os.open(f, os.O_WRONLY | os.O_CREAT, 0o600)
    chunk = b"\0" * (64 << 10)
    try:
        while True:
            try:
                if os.write(fd, chunk) < len(chunk):
                    break
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                break
    finally:
        os.close(fd)
    assert os.statvfs(root).f_bavail == 0
    return f


def _punch(path, size: int) -> None:
    """Give the file's blocks back to its filesystem (its size stays): writes into it need
    new space again, as in a sparse file."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    fd = os.open(path, os.O_RDWR)
    try:
        if libc.fallocate(fd, 0x01 | 0x02, 0, size) != 0:  # KEEP_SIZE | PUNCH_HOLE
            raise OSError(ctypes.get_errno(), "fallocate(PUNCH_HOLE)")
    finally:
        os.close(fd)


def test_a_full_disk_fails_demotion_cleanly_keeps_memory_and_recovers(tmp_path):
    """The disk file on a small filesystem (a tmpfs of the node's own mount namespace) whose
    space runs out after the node started: every demotion write fails with ENOSPC. The node
    says so and reports them failed, ending nothing; the master revokes the demotions; no
    disk copy is ever listed, every object stays in memory and reads byte-exact. Once space
    is back, demotion resumes and the disk copies hold exactly their objects' bytes."""
    mnt = tmp_path / "mnt"
    pre = _small_fs(mnt, f"size={DISK + (1 << 20)}")
    (port,) = free_ports(1)
    addr = f"127.0.0.1:{port}"
    procs = [_master(tmp_path, addr, "--demote-timeout-s", "1")]
    c = None
    try:
        n = subprocess.Popen(
            [*pre, sys.executable, "-m", "kvmesh.cli", "node", "--master", addr, "--size",
             str(MEM), "--heartbeat-s", "0.05", *_disk_args(mnt / "tier.seg")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV,
        )  # fmt: skip
        procs.append(n)
        _line(n, "READY node")
        root = f"/proc/{n.pid}/root{mnt}"  # the node's view of its filesystem
        path = f"{root}/tier.seg"
        _punch(path, DISK)
        filler = _fill_fs(root)
        c = StoreClient(addr, timeout=10, segment_size=0)
        keys = [f"obj-{i}" for i in range(24)]  # 1.5 MiB of 2: past 0.4, under 0.9
        for lo in range(0, len(keys), 8):
            _put(c, keys[lo : lo + 8])
        fails, end = 0, time.monotonic() + 60
        while fails < 2:  # the node tries, fails and says why; the master revokes the
            # batch after its timeout and hands it out again, which fails the same way
            assert time.monotonic() < end, "the node reported no failed demotion"
            ended = c.status()["requests"].get("demote_ended", 0)
            assert ended == 0, "a demotion was ended while every disk write fails"
            try:
                line = _line(n, "WARNING:kvmesh.store.node", timeout=0.5)
            except AssertionError:
                continue  # no line yet
            if "demotion of" in line:
                assert "failed" in line and "No space left" in line, line
                fails += 1
        # The master's state is polled by status only: a lookup leases the keys, and leased
        # objects are not demoted.
        st = c.status()
        assert st["requests"].get("demote_ended", 0) == 0  # the node ended nothing
        assert st["requests"].get("demote_failed", 0) > 0  # it reported the failures
        assert st["requests"].get("demoted", 0) == 0  # no memory copy was freed
        assert st["media"]["memory"]["used"] >= len(keys) * SIZE
        cs = _copies(c, keys)  # a COMPLETE disk copy would still be listed
        assert [k for k, v in cs.items() if any(_on_disk(cp) for cp in v)] == []
        got = c.get(keys)
        assert [g == _value(_idx(k)) for k, g in zip(keys, got)] == [True] * len(keys)
        assert got.media == ["memory"] * len(keys)
        os.unlink(filler)  # space again: the next demotions succeed (after the backoff)
        _until(lambda: c.status()["requests"].get("demote_ended", 0) > 0)
        cs = _copies(c, keys)
        done = {k: cp for k, v in cs.items() for cp in v if _on_disk(cp)}
        assert done
        for k, cp in done.items():
            assert _file_bytes(path, cp) == _value(_idx(k)), k
        got = c.get(keys)
        assert [g == _value(_idx(k)) for k, g in zip(keys, got)] == [True] * len(keys)
    finally:
        if c is not None:
            c.close()
        _stop(procs)


def test_failed_demotions_are_reported_revoked_and_backed_off_never_evicting_memory(tmp_path):
    """Every demotion write fails with ENOSPC (the filesystem under the disk file is full,
    the disk segment itself has room). The node reports the failures (``DemoteEndReq
    .failed``); the master counts them (``demote_failed``), revokes them at once -- the
    disk bytes are free long before the demotion timeout -- and backs off from the disk
    before it tries again. Meanwhile memory goes over its eviction watermark: the objects
    in memory only are not evicted for it (the disk has room, it is only backing off), and
    every acknowledged put reads byte-exact. With space back, demotion resumes and memory
    is freed by dropping the memory copies now on disk."""
    mnt = tmp_path / "mnt"
    pre = _small_fs(mnt, f"size={DISK + (1 << 20)}")
    (port,) = free_ports(1)
    addr = f"127.0.0.1:{port}"
    procs = [_master(tmp_path, addr, "--demote-timeout-s", "20")]
    c = None
    try:
        n = subprocess.Popen(
            [*pre, sys.executable, "-m", "kvmesh.cli", "node", "--master", addr, "--size",
             str(MEM), "--heartbeat-s", "0.05", *_disk_args(mnt / "tier.seg")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV,
        )  # fmt: skip
        procs.append(n)
        _line(n, "READY node")
        root = f"/proc/{n.pid}/root{mnt}"
        path = f"{root}/tier.seg"
        _punch(path, DISK)
        filler = _fill_fs(root)
        c = StoreClient(addr, timeout=10, segment_size=0)

        def st() -> dict:
            s = c.status()  # (status only until the reads: a lookup leases the keys)
            return {**s["requests"], "disk_used": s["media"]["disk"]["used"]}

        keys = [f"obj-{i}" for i in range(24)]  # 1.5 MiB of 2: past 0.4, under 0.9
        for lo in range(0, len(keys), 8):
            _put(c, keys[lo : lo + 8])
        # reported and revoked: the PROCESSING disk copies freed well within the 20 s
        # demotion timeout (the revoke came from the report), then tried again
        _until(lambda: (s := st()).get("demote_failed", 0) > 0 and s["disk_used"] == 0,
               timeout=10, step=0.01, msg="a failed demotion revoked at once")  # fmt: skip
        _until(lambda: st().get("demote_failed", 0) > len(keys), msg="tried again")
        # memory over its 90 % watermark while the disk backs off: 30 of 32 slots
        more = [f"obj-{i}" for i in range(24, 30)]
        _put(c, more)
        keys += more
        seen = st()["demote_failed"]
        _until(lambda: st()["demote_failed"] > seen, msg="tried again over the watermark")
        s = st()
        assert s.get("evicted", 0) == 0, "an object in memory only was evicted for a backoff"
        assert s.get("demote_ended", 0) == 0 and s.get("demoted", 0) == 0
        got = c.get(keys)
        assert [g == _value(_idx(k)) for k, g in zip(keys, got)] == [True] * len(keys)
        assert got.media == ["memory"] * len(keys)
        assert [k for k, v in _copies(c, keys).items() if any(_on_disk(cp) for cp in v)] == []
        os.unlink(filler)  # space again: demotion resumes, then memory copies on disk go
        _until(lambda: st().get("demoted", 0) > 0, timeout=60, msg="demotion resumed")
        assert st().get("evicted", 0) == 0
        got = c.get(keys)
        assert [g == _value(_idx(k)) for k, g in zip(keys, got)] == [True] * len(keys)
        done = {k: cp for k, v in _copies(c, keys).items() for cp in v if _on_disk(cp)}
        assert done
        for k, cp in done.items():
            assert _file_bytes(path, cp) == _value(_idx(k)), k
    finally:
        if c is not None:
            c.close()
        _stop(procs)


def test_a_full_disk_tier_evicts_as_without_it_and_never_corrupts(tiered_small_disk):
    """A disk tier of 1 MiB under 2 MiB of memory and 6 MiB of puts: demotion stops when the
    disk has no room (NoSpace), the objects that fit nowhere are evicted (reported missing),
    and every object still found reads byte-exact, from memory or disk."""
    c, path = tiered_small_disk
    keys = [f"obj-{i}" for i in range(96)]
    for lo in range(0, len(keys), 8):
        _put(c, keys[lo : lo + 8])
        _settle(c)
    st = c.status()
    disk = st["media"]["disk"]
    assert 0 < disk["used"] <= disk["capacity"]
    assert st["requests"].get("evicted", 0) > 0
    got = c.get(keys)
    found = [(k, g) for k, g in zip(keys, got) if not isinstance(g, E.ObjectNotFound)]
    assert [g == _value(_idx(k)) for k, g in found] == [True] * len(found), found[:2]
    assert len(found) < len(keys)
    media = dict(zip(keys, got.media))
    copies = _copies(c, [k for k, _ in found])
    # Some found objects hold a disk copy (the disk is in use). Whether a demoted object's
    # memory copy is dropped yet, so that its read is served from disk, depends on timing;
    # a key served from disk must have a disk copy, and every disk copy holds its bytes.
    assert any(_on_disk(cp) for cs in copies.values() for cp in cs), copies
    for k, cs in copies.items():
        if media[k] == "disk":
            assert any(_on_disk(cp) for cp in cs), (k, cs)
        for cp in cs:
            if _on_disk(cp):
                assert _file_bytes(path, cp) == _value(_idx(k))


@pytest.fixture
def tiered_small_disk(tmp_path):
    (port,) = free_ports(1)
    addr = f"127.0.0.1:{port}"
    path = tmp_path / "tier.seg"
    procs = [_master(tmp_path, addr)]
    c = None
    try:
        procs.append(_node(addr, *_disk_args(path, 1 << 20)))
        c = StoreClient(addr, timeout=10, segment_size=0)
        yield c, path
    finally:
        if c is not None:
            c.close()
        _stop(procs)


# ------------------------------------------------------------------ two nodes, forced network


def test_staged_demotion_and_forced_network_disk_reads_report_medium_and_transport(tmp_path):
    """Node A: memory only; node B: memory and the disk. Objects A holds are demoted into
    B's disk through B's staging buffer (their memory copy is on another node). A reader
    forced onto TCP as if on another host, and this process's reader (shared memory where
    it can): disk-only objects read byte-exact, single and batch; a batch mixing memory and
    disk copies reports per key the medium and the transport that served it."""
    (port,) = free_ports(1)
    addr = f"127.0.0.1:{port}"
    path = tmp_path / "tier.seg"
    procs = [_master(tmp_path, addr)]
    c = far = far_eng = None
    try:
        procs.append(_node(addr))  # A
        procs.append(_node(addr, *_disk_args(path)))  # B
        c = StoreClient(addr, timeout=10, segment_size=0)
        disk_seg = _disk_name(c)
        b_mem = _disk_node_memory(c)
        (a_mem,) = [
            s["name"]
            for s in c.status()["segments"]
            if s["medium"] == "memory" and s["name"] != b_mem
        ]
        keys = [f"obj-{i}" for i in range(96)]  # 6 MiB: 1.5 x both memory segments
        first: dict[str, str] = {}
        for lo in range(0, len(keys), 8):
            part = keys[lo : lo + 8]
            _put(c, part)
            for k, cs in _copies(c, part).items():
                first.setdefault(k, cs[0][0].segment)
            _settle(c)
        copies = _copies(c, keys)
        assert set(copies) == set(keys)
        disk_only = [k for k, cs in copies.items() if all(_on_disk(cp) for cp in cs)]
        # objects with a memory copy (served from it, memory first): demotion may have given
        # every object a disk copy by now, their memory kept while memory is under its
        # watermark (no writer: nothing drops it)
        in_mem = [k for k, cs in copies.items() if not all(_on_disk(cp) for cp in cs)]
        staged = [k for k in disk_only if first[k] == a_mem]
        assert staged, f"no disk-only object came from the other node's memory: {first}"
        assert in_mem, "nothing left in memory"
        for k in staged:
            (cp,) = copies[k]
            assert cp[0].segment == disk_seg
            assert _file_bytes(path, cp) == _value(_idx(k))
        mixed = disk_only[:8] + in_mem[:8]
        far_eng = TransferEngine(config=EngineConfig(transport="tcp", host_id="another-host"))
        far = StoreClient(addr, timeout=10, segment_size=0, engine=far_eng)
        want_media = ["disk"] * len(disk_only[:8]) + ["memory"] * len(in_mem[:8])
        for client, mem_via in ((far, {"tcp"}), (c, {"shm"})):
            got = client.get(mixed)
            assert [g == _value(_idx(k)) for k, g in zip(mixed, got)] == [True] * len(mixed)
            assert got.media == want_media, (got.media, want_media)
            tr = got.key_transports
            assert set(tr[: len(disk_only[:8])]) == {"tcp"}, tr  # the owner pushes its file
            assert set(tr[len(disk_only[:8]) :]) == mem_via, tr
            # into a registered buffer (the zero-copy form): the same columns
            buf = np.zeros(len(mixed) * SIZE, np.uint8)
            region = client.register_buffer(buf)
            got = client.get_into(mixed, region, [i * SIZE for i in range(len(mixed))])
            assert list(got) == [SIZE] * len(mixed)
            assert got.media == want_media
            for i, k in enumerate(mixed):
                assert buf[i * SIZE : (i + 1) * SIZE].tobytes() == _value(_idx(k))
            for k in staged[:4]:  # single gets of disk-only objects
                assert client.get(k) == _value(_idx(k))
                assert client.last_transports == ["tcp"]
        assert not any(isinstance(g, Exception) for g in far.get(keys))
        r = c.get([disk_only[0], "obj-none", in_mem[0]])  # a key not found: not read
        assert isinstance(r[1], E.ObjectNotFound)
        assert r.media == ["disk", "", "memory"] and r.key_transports == ["tcp", "", "shm"]
    finally:
        for x in (far, c, far_eng):
            if x is not None:
                x.close()
        _stop(procs)
