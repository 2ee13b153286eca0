"""Registered memory: regions, the per-engine address index, and shared-memory buffers.

A :class:`MemoryRegion` is one contiguous range of this process's memory that transfers may
touch. It keeps the object that owns the bytes alive (numpy array, tensor, bytearray, shared
buffer) and counts the jobs using it, so unregistering never frees memory under a transfer.

:class:`SharedBuffer` allocates host memory in a named file under ``/dev/shm`` with raw
``open``/``ftruncate``/``mmap`` (not ``multiprocessing.shared_memory``, whose resource tracker
unlinks segments that other processes merely attached). Peers on the same host map the file
and copy into it directly.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import itertools
import mmap
import os
import threading
import time
from typing import Any

import numpy as np

from . import shmfile
from .errors import EngineClosed, InvalidArgument, InvalidLength, NotRegistered, TransferTimeout
from .shmfile import SHM_DIR, SHM_PREFIX
from .types import MemoryKind

_PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_HUGEPAGE = 14


def host_array(ptr: int, size: int) -> np.ndarray:
    """A ``uint8`` numpy view of ``size`` bytes at host address ``ptr`` (no ownership)."""
    if size == 0:
        return np.empty(0, np.uint8)
    buf = (ctypes.c_ubyte * size).from_address(ptr)
    return np.frombuffer(buf, dtype=np.uint8)


def map_file(fd: int, size: int, offset: int = 0, *, populate: bool = True) -> int:
    """mmap ``size`` bytes of ``fd`` at ``offset`` (page aligned) shared read/write; return the
    address."""
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0x8000) if populate else 0)
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    # Best effort: huge pages make scattered page reads cheaper (fewer TLB misses); the kernel
    # ignores it when shmem THP is off.
    _libc.madvise(addr, size, _MADV_HUGEPAGE)
    return addr


def unmap(addr: int, size: int) -> None:
    if _libc.munmap(addr, size) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap failed: {os.strerror(err)}")


class SharedBuffer:
    """Host memory in a ``/dev/shm`` file, mapped into this process.

    The creating process owns the name: it keeps the file open with its liveness lock held
    (see :mod:`kvmesh.transfer.shmfile`), and ``close()`` unmaps and unlinks it. Peers attach
    with :meth:`attach` (the shared-memory transport does that) and only unmap on close.
    """

    __slots__ = ("name", "size", "addr", "owner", "_fd", "_closed", "__weakref__")

    def __init__(self, name: str, size: int, addr: int, owner: bool, fd: int = -1) -> None:
        self.name = name
        self.size = size
        self.addr = addr
        self.owner = owner
        self._fd = fd  # the owner's open file, holding the liveness lock
        self._closed = False

    @classmethod
    def create(cls, size: int, *, populate: bool = True) -> SharedBuffer:
        """Allocate ``size`` bytes (rounded up to pages) in a new ``/dev/shm`` file."""
        if size <= 0:
            raise InvalidLength(f"shared buffer size must be positive, got {size}")
        size = (size + _PAGE - 1) // _PAGE * _PAGE
        name, fd = shmfile.create(size)
        try:
            shmfile.reserve(fd, size, commit=populate)
            addr = map_file(fd, size, populate=populate)
        except BaseException:
            os.unlink(os.path.join(SHM_DIR, name))
            os.close(fd)
            raise
        buf = cls(name, size, addr, owner=True, fd=fd)
        _register_shared(buf)
        return buf

    @classmethod
    def attach(cls, name: str, *, populate: bool = True) -> SharedBuffer:
        """Map a ``/dev/shm`` file created by another engine (whole file).

        ``name`` usually comes from a peer: it is checked and opened as
        :func:`~kvmesh.transfer.shmfile.open_peer` says (``InvalidArgument`` if refused).
        """
        fd, st = shmfile.open_peer(name)
        try:
            size = st.st_size
            if size == 0:
                raise InvalidLength(f"shared-memory file {name!r} is empty")
            addr = map_file(fd, size, populate=populate)
        finally:
            os.close(fd)
        return cls(name, size, addr, owner=False)

    def array(self) -> np.ndarray:
        """A ``uint8`` numpy view of the whole buffer (valid until ``close``)."""
        if self._closed:
            raise EngineClosed(f"shared buffer {self.name!r} is closed")
        return host_array(self.addr, self.size)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap (and unlink, for the owner). Views taken with ``array()`` become invalid."""
        if self._closed:
            return
        self._closed = True
        if self.owner:
            _unregister_shared(self)
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass
            os.close(self._fd)
        unmap(self.addr, self.size)

    def __repr__(self) -> str:
        return f"SharedBuffer({self.name!r}, size={self.size}, owner={self.owner})"


# Shared buffers this process created, by start address: registering any object that lies
# inside one (a numpy view, a tensor built on it) makes that region SHM automatically.
_shared_lock = threading.Lock()
_shared_starts: list[int] = []
_shared_bufs: dict[int, SharedBuffer] = {}


def _register_shared(buf: SharedBuffer) -> None:
    with _shared_lock:
        bisect.insort(_shared_starts, buf.addr)
        _shared_bufs[buf.addr] = buf


def _unregister_shared(buf: SharedBuffer) -> None:
    with _shared_lock:
        if _shared_bufs.pop(buf.addr, None) is not None:
            _shared_starts.remove(buf.addr)


def shared_buffer_at(ptr: int, size: int) -> SharedBuffer | None:
    """The live shared buffer of this process that contains ``[ptr, ptr + size)``, if any."""
    with _shared_lock:
        i = bisect.bisect_right(_shared_starts, ptr) - 1
        if i < 0:
            return None
        buf = _shared_bufs[_shared_starts[i]]
        return buf if ptr + size <= buf.addr + buf.size else None


def sweep_dead_shared(prefix: str = SHM_PREFIX) -> list[str]:
    """Unlink ``/dev/shm`` files of kvmesh owners (of our uid) that are gone (see shmfile)."""
    return shmfile.sweep(prefix)


_region_ids = itertools.count(1)
_live_lock = threading.Lock()
_live_regions: dict[int, MemoryRegion] = {}


def find_live_region(region_id: int) -> MemoryRegion | None:
    """A registered region of this process by id, whichever engine registered it."""
    return _live_regions.get(region_id)


class Users:
    """Something jobs use and ``unregister`` gives back: a region id, a count of the jobs
    using it, and a close that refuses new users and waits (bounded) for the running ones.
    Memory regions and disk segments (``disk.py``) share it, so both are given back alike.
    """

    __slots__ = ("region_id", "_users", "_closed", "_cond")

    def __init__(self) -> None:
        self.region_id = next(_region_ids)  # unique per process, never reused (fence.py)
        self._users = 0
        self._closed = False
        self._cond = threading.Condition(threading.Lock())

    @property
    def closed(self) -> bool:
        return self._closed

    def acquire(self) -> None:
        """Mark one more job as using it; refused once unregistering started."""
        with self._cond:
            if self._closed:
                raise NotRegistered(f"{self._what()} was unregistered")
            self._users += 1

    def release(self) -> None:
        with self._cond:
            self._users -= 1
            if self._users == 0 and self._closed:
                self._cond.notify_all()

    def wait_unused(self, timeout: float) -> None:
        """Refuse new users, then wait (bounded) until running jobs are done."""
        with self._cond:
            self._closed = True
            end = time.monotonic() + timeout
            while self._users > 0:
                left = end - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(
                        f"{self._what()} is still used by {self._users} "
                        f"transfer(s) after {timeout:.1f}s"
                    )
                self._cond.wait(left)

    def _what(self) -> str:
        return f"memory region {self.region_id}"


class MemoryRegion(Users):
    """A registered, contiguous range of this process's memory.

    Handles are returned by ``TransferEngine.register*``; offsets in requests are relative to
    ``ptr``. ``owner`` keeps the backing object alive for as long as the region is registered.
    """

    __slots__ = (
        "ptr",
        "size",
        "kind",
        "device",
        "owner",
        "shm",
        "shm_offset",
        "name",
        "transport_data",
        "_array",
        "__weakref__",
    )

    def __init__(
        self,
        ptr: int,
        size: int,
        kind: MemoryKind,
        device: int = -1,
        owner: Any = None,
        shm: SharedBuffer | None = None,
    ) -> None:
        super().__init__()
        self.ptr = ptr
        self.size = size
        self.kind = kind
        self.device = device
        self.owner = owner
        self.shm = shm
        self.shm_offset = ptr - shm.addr if shm is not None else 0
        self.name: str | None = None  # segment name when published
        self.transport_data: dict[str, Any] = {}  # per-transport state (NIXL descriptors...)
        self._array: np.ndarray | None = None
        with _live_lock:
            _live_regions[self.region_id] = self

    @property
    def is_host(self) -> bool:
        return self.kind is not MemoryKind.VRAM

    def array(self) -> np.ndarray:
        """A ``uint8`` numpy view of the region (host memory only)."""
        if not self.is_host:
            raise InvalidArgument(f"region {self.region_id} is GPU memory; it has no host view")
        arr = self._array
        if arr is None:
            arr = self._array = host_array(self.ptr, self.size)
        return arr

    def close(self, timeout: float) -> None:
        """Refuse new users, then wait (bounded) until running jobs are done with the region."""
        self.wait_unused(timeout)
        with _live_lock:
            _live_regions.pop(self.region_id, None)
        self._array = None

    def contains(self, ptr: int, length: int) -> bool:
        return self.ptr <= ptr and ptr + length <= self.ptr + self.size

    def __repr__(self) -> str:
        dev = f", device={self.device}" if self.device >= 0 else ""
        return (
            f"MemoryRegion(id={self.region_id}, ptr=0x{self.ptr:x}, size={self.size}, "
            f"kind={self.kind.value}{dev})"
        )


def describe_object(
    obj: Any, kind: MemoryKind | None = None, device: int | None = None
) -> tuple[int, int, MemoryKind, int, Any]:
    """``(ptr, size, kind, device, owner)`` of a numpy array, torch tensor or writable buffer."""
    if isinstance(obj, SharedBuffer):
        return obj.addr, obj.size, MemoryKind.SHM, -1, obj
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InvalidArgument("only C-contiguous numpy arrays can be registered")
        if not obj.flags.writeable:
            raise InvalidArgument("read-only numpy arrays cannot be registered (peers may write)")
        return (
            obj.ctypes.data,
            obj.nbytes,
            kind or MemoryKind.DRAM,
            -1 if device is None else device,
            obj,
        )
    mod = type(obj).__module__
    if mod.startswith("torch"):
        if not obj.is_contiguous():
            raise InvalidArgument("only contiguous torch tensors can be registered")
        size = obj.numel() * obj.element_size()
        if obj.is_cuda:
            dev = obj.device.index if obj.device.index is not None else 0
            return obj.data_ptr(), size, MemoryKind.VRAM, dev, obj
        if obj.device.type != "cpu":
            raise InvalidArgument(f"tensors on {obj.device.type!r} cannot be registered")
        return obj.data_ptr(), size, kind or MemoryKind.DRAM, -1, obj
    try:
        mv = memoryview(obj)
    except TypeError:
        raise InvalidArgument(
            f"cannot register {type(obj).__name__}: expected a numpy array, torch tensor, "
            f"bytearray/memoryview or SharedBuffer (use register_raw for pointers)"
        ) from None
    if mv.readonly:
        raise InvalidArgument("read-only buffers cannot be registered (peers may write into them)")
    if not mv.c_contiguous:
        raise InvalidArgument("only contiguous buffers can be registered")
    arr = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes, kind or MemoryKind.DRAM, -1, (obj, arr)


class RegionIndex:
    """The regions one engine registered, searchable by address. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[int, MemoryRegion] = {}
        self._starts: np.ndarray | None = None  # sorted start addresses, rebuilt lazily
        self._ends: np.ndarray | None = None
        self._sorted: list[MemoryRegion] = []
        self._py_starts: list[int] = []  # the same starts as Python ints (find)

    def add(self, region: MemoryRegion) -> None:
        with self._lock:
            self._by_id[region.region_id] = region
            self._starts = None

    def remove(self, region: MemoryRegion) -> None:
        with self._lock:
            if self._by_id.pop(region.region_id, None) is None:
                raise NotRegistered(f"{region!r} is not registered with this engine")
            self._starts = None

    def get(self, region_id: int) -> MemoryRegion | None:
        return self._by_id.get(region_id)

    def __contains__(self, region: MemoryRegion) -> bool:
        return self._by_id.get(region.region_id) is region

    def all(self) -> list[MemoryRegion]:
        with self._lock:
            return list(self._by_id.values())

    def _index(self) -> tuple[np.ndarray, np.ndarray, list[MemoryRegion]]:
        with self._lock:
            if self._starts is None:
                self._rebuild()
            return self._starts, self._ends, self._sorted  # type: ignore[return-value]

    def _rebuild(self) -> None:  # under self._lock
        regs = sorted(self._by_id.values(), key=lambda r: (r.ptr, -r.size))
        self._sorted = regs
        self._py_starts = [r.ptr for r in regs]
        self._starts = np.array(self._py_starts, dtype=np.uint64)
        self._ends = np.array([r.ptr + r.size for r in regs], dtype=np.uint64)

    def find(self, ptr: int, length: int = 1) -> tuple[MemoryRegion, int]:
        """The region holding ``[ptr, ptr + length)`` and the offset of ``ptr`` in it."""
        with self._lock:
            if self._starts is None:
                self._rebuild()
            starts, regs = self._py_starts, self._sorted
        # One address (every single get): bisect on Python ints, not a numpy search.
        i = bisect.bisect_right(starts, ptr) - 1
        while i >= 0:  # overlapping registrations: walk back to one that covers the range
            r = regs[i]
            if ptr + length <= r.ptr + r.size:
                return r, ptr - r.ptr
            i -= 1
        raise NotRegistered(f"address range 0x{ptr:x}+{length} is not inside registered memory")

    def find_many(
        self, ptrs: np.ndarray, lengths: np.ndarray
    ) -> tuple[list[MemoryRegion], np.ndarray, np.ndarray]:
        """Vectorised :meth:`find`: ``(regions, region_index_per_request, offsets)``."""
        ptrs = np.asarray(ptrs, dtype=np.uint64)
        lengths = np.asarray(lengths, dtype=np.uint64)
        starts, ends, regs = self._index()
        if len(regs) == 0:
            raise NotRegistered("no memory is registered with this engine")
        idx = np.searchsorted(starts, ptrs, side="right").astype(np.int64) - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        ok &= ptrs + lengths <= ends[safe]
        if not ok.all():
            for j in np.flatnonzero(~ok):  # rare: overlaps, or a genuinely bad address
                reg, _ = self.find(int(ptrs[j]), int(lengths[j]))
                safe[j] = regs.index(reg)
        return regs, safe, ptrs - starts[safe]
