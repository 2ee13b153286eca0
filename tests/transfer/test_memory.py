"""Registration of every kind of memory, the address index, shared-memory buffers."""

import gc
import os
import secrets
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from kvmesh.transfer import (
    InvalidArgument,
    InvalidLength,
    MemoryKind,
    NotRegistered,
    SharedBuffer,
    TransferTimeout,
)
from kvmesh.transfer.memory import SHM_DIR, MemoryRegion, sweep_dead_shared


def test_register_numpy_torch_bytearray_memoryview_raw(make_engine):
    eng = make_engine()
    arr = np.arange(1000, dtype=np.float32)
    r = eng.register(arr)
    assert (r.ptr, r.size, r.kind, r.device) == (arr.ctypes.data, 4000, MemoryKind.DRAM, -1)
    t = torch.arange(10, dtype=torch.int64)
    r = eng.register(t)
    assert (r.ptr, r.size) == (t.data_ptr(), 80)
    ba = bytearray(b"x" * 100)
    r = eng.register(ba)
    assert r.size == 100 and bytes(r.array()[:3]) == b"xxx"
    mv = memoryview(bytearray(64)).cast("I")
    r = eng.register(mv)
    assert r.size == 64
    r.array()[:4] = 1
    assert mv[0] == 0x01010101  # the region aliases the caller's memory
    r = eng.register_raw(arr.ctypes.data + 8, 16, owner=arr)
    assert r.ptr == arr.ctypes.data + 8 and r.kind is MemoryKind.DRAM


def test_registration_keeps_the_owner_alive(make_engine):
    eng = make_engine()

    class Owned(np.ndarray):
        pass

    arr = np.full(1 << 16, 9, dtype=np.uint8).view(Owned)
    ref = weakref.ref(arr)
    r = eng.register(arr)
    del arr
    gc.collect()
    assert ref() is not None and (r.array() == 9).all()
    eng.unregister(r)
    del r
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize(
    "obj, match",
    [
        (np.zeros((8, 8))[:, ::2], "contiguous"),
        (np.frombuffer(b"readonly", dtype=np.uint8), "read-only"),
        (b"bytes are immutable", "read-only"),
        (torch.zeros(4, 4).t(), "contiguous"),
        (object(), "cannot register"),
    ],
)
def test_unregistrable_objects_are_refused(make_engine, obj, match):
    with pytest.raises(InvalidArgument, match=match):
        make_engine().register(obj)


def test_raw_registration_checks_size_and_address(make_engine):
    eng = make_engine()
    with pytest.raises(InvalidLength):
        eng.register_raw(0x1000, 0)
    with pytest.raises(InvalidArgument):
        eng.register_raw(0, 10)
    with pytest.raises(InvalidArgument, match="SharedBuffer"):
        eng.register_raw(np.zeros(8).ctypes.data, 8, kind="shm")


def test_memory_inside_a_shared_buffer_registers_as_shm(make_engine):
    eng = make_engine()
    buf = SharedBuffer.create(1 << 20)
    try:
        view = buf.array()[4096:8192]
        r = eng.register(view)
        assert r.kind is MemoryKind.SHM and r.shm is buf and r.shm_offset == 4096
        desc = eng.publish(r, "half")
        assert desc.shm_name == buf.name and desc.shm_offset == 4096 and desc.shm_size == buf.size
        eng.unregister(r)
    finally:
        buf.close()


def test_alloc_shared_is_freed_on_unregister(make_engine):
    eng = make_engine()
    r = eng.alloc_shared(3 << 20, name="seg")
    path = os.path.join(SHM_DIR, r.shm.name)
    assert os.path.exists(path) and r.kind is MemoryKind.SHM and r.size == 3 << 20
    r.array()[:] = 1
    eng.unregister(r)
    assert not os.path.exists(path)
    assert eng.segments() == []


def test_find_region_and_vectorised_lookup(make_engine):
    eng = make_engine()
    a, b = np.zeros(4096, np.uint8), np.zeros(8192, np.uint8)
    ra, rb = eng.register(a), eng.register(b)
    assert eng.find_region(a.ctypes.data + 100, 50) == (ra, 100)
    assert eng.find_region(b.ctypes.data + 8191) == (rb, 8191)
    with pytest.raises(NotRegistered):
        eng.find_region(a.ctypes.data + 4000, 200)  # runs past the end of a
    ptrs = np.array([a.ctypes.data, b.ctypes.data + 10, a.ctypes.data + 4095], np.uint64)
    regs, idx, offs = eng.find_regions(ptrs, np.array([1, 10, 1]))
    assert [regs[i] for i in idx] == [ra, rb, ra] and offs.tolist() == [0, 10, 4095]
    # Overlapping registrations: the covering one is found.
    inner = eng.register_raw(a.ctypes.data + 1024, 1024, owner=a)
    assert eng.find_region(a.ctypes.data + 3000, 100)[0] is ra
    assert eng.find_region(a.ctypes.data + 1100, 10)[0] in (ra, inner)
    with pytest.raises(NotRegistered):
        eng.find_regions(np.array([1], np.uint64), np.array([1]))


def test_unregister_twice_and_foreign_regions(make_engine):
    e1, e2 = make_engine(), make_engine()
    r = e1.register(np.zeros(16, np.uint8))
    with pytest.raises(NotRegistered):
        e2.unregister(r)
    e1.unregister(r)
    with pytest.raises(NotRegistered):
        e1.unregister(r)


def test_region_close_waits_for_users_bounded():
    r = MemoryRegion(0x1000, 10, MemoryKind.DRAM)
    r.acquire()
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        r.close(0.2)
    assert time.monotonic() - t0 < 2
    with pytest.raises(NotRegistered):
        r.acquire()  # closing refuses new users even though the old one is still there
    threading.Timer(0.1, r.release).start()
    r.close(5.0)  # returns once the last user released


def test_shared_buffer_attach_sees_writes_and_owner_unlinks():
    owner = SharedBuffer.create(10_000)
    assert owner.size % 4096 == 0 and owner.size >= 10_000
    peer = SharedBuffer.attach(owner.name)
    owner.array()[:5] = [1, 2, 3, 4, 5]
    assert peer.array()[:5].tolist() == [1, 2, 3, 4, 5]
    owner.close()
    assert not os.path.exists(os.path.join(SHM_DIR, owner.name))
    peer.array()[0] = 7  # the peer's mapping stays valid after unlink
    peer.close()
    with pytest.raises(FileNotFoundError):
        SharedBuffer.attach(owner.name)
    with pytest.raises(InvalidLength):
        SharedBuffer.create(0)


# Holds an OFD write lock on byte 0 of a new file, as a live owner does, until stdin closes.
_HOLDER = r"""
import fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 1, 0))
print("locked", flush=True)
sys.stdin.read()
"""


def test_sweep_judges_liveness_by_the_owners_lock_not_its_pid():
    # Every name encodes a pid that is dead here, as an owner in another pid namespace would.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = {k: f"kvmesh-{dead.pid}-{secrets.token_hex(6)}" for k in ("held", "orphan", "foreign")}
    path = {k: os.path.join(SHM_DIR, n) for k, n in names.items()}
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, path["held"]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    mine = SharedBuffer.create(4096)  # alive in this very process: no shortcut for our own pid
    try:
        assert holder.stdout.readline().strip() == "locked"
        for k in ("orphan", "foreign"):
            with open(path[k], "wb") as f:
                f.write(b"x")
        other_uid = os.getuid() == 0
        if other_uid:  # only root can give a file away
            os.chown(path["foreign"], 4242, 4242)
        removed = sweep_dead_shared()
        assert names["orphan"] in removed and not os.path.exists(path["orphan"])
        assert names["held"] not in removed and os.path.exists(path["held"])
        assert mine.name not in removed and os.path.exists(os.path.join(SHM_DIR, mine.name))
        if other_uid:
            assert names["foreign"] not in removed and os.path.exists(path["foreign"])
        # The holder dies: the kernel drops its lock, and the next sweep takes the file.
        holder.stdin.close()
        holder.wait(10)
        assert names["held"] in sweep_dead_shared() and not os.path.exists(path["held"])
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        mine.close()
        for p in path.values():
            if os.path.exists(p):
                os.unlink(p)
