"""The fastest host-memory copy reachable from Python without compiling anything.

Two kernels are reachable, both bit-exact and both releasing the GIL:

* ``memmove`` (glibc): between ~2 KiB and its non-temporal threshold it copies with
  ``rep movsb``. On Intel CPUs with ERMS/FSRM that was never slower than the SIMD loop below
  for scattered 64-512 KiB pages between ``/dev/shm`` mappings (4 KiB pages), up to 1.45x
  faster, and 1.8x for a long run (docs/transfer.md, "Copies: which kernel").
* OpenBLAS ``dcopy`` from NumPy's bundled OpenBLAS, a plain SIMD loop: on AMD EPYC (the VM
  this was first built on) ``rep movsb`` ran 3-4x slower when the *source* lay in 4 KiB
  pages, the normal case for a shared-memory segment; ``dcopy`` reached 6.5 GB/s for 256 KiB
  reads out of a mapping where memmove made 1.6-2.5.

Selection (``BACKEND`` says which and why): ``KVMESH_COPY=memmove`` or ``KVMESH_COPY=dcopy``
forces one; otherwise ``dcopy`` on AMD and Hygon CPUs (``vendor_id`` in ``/proc/cpuinfo``),
``memmove`` elsewhere. ``dcopy`` is used only after a bit-exact check at import (NaN payloads
included), for 8-byte aligned blocks of at least ``_MIN_BLAS`` bytes. No kernel with
non-temporal stores is reachable without compiling (none of the bundled libraries exports
one: docs/transfer.md), so scattered pages copy through the cache either way.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from collections.abc import Callable

import numpy as np

memmove = ctypes.memmove
_MIN_BLAS = 2048  # below this glibc does not use rep movsb anyway and call overhead dominates


_SIMD_VENDORS = ("AuthenticAMD", "HygonGenuine")  # slow rep movsb from 4 KiB-page sources


def cpu_vendor() -> str:
    """``vendor_id`` of the first CPU in ``/proc/cpuinfo`` ('' when unknown)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def choose_kernel(env: str, vendor: str) -> tuple[str, str]:
    """``(kernel, reason)``: the kernel for ``KVMESH_COPY=env`` on a CPU of ``vendor``."""
    env = env.strip().lower()
    if env in ("memmove", "dcopy"):
        return env, "KVMESH_COPY"
    if env not in ("", "auto"):
        raise ValueError(f"KVMESH_COPY={env!r}: expected memmove, dcopy or auto")
    if vendor in _SIMD_VENDORS:
        return "dcopy", f"{vendor}: rep movsb is slow from 4 KiB pages"
    return "memmove", f"{vendor or 'unknown CPU'}: rep movsb"


def find_dcopy() -> tuple[Callable[..., None] | None, str]:
    """NumPy's bundled OpenBLAS ``dcopy`` once it copied bit-exact, and its library name."""
    libdir = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    candidates = [
        ("libscipy_openblas64_*.so*", "scipy_cblas_dcopy64_", ctypes.c_int64),
        ("libopenblas64_*.so*", "cblas_dcopy64_", ctypes.c_int64),
        ("libscipy_openblas*.so*", "scipy_cblas_dcopy", ctypes.c_int),
        ("libopenblas*.so*", "cblas_dcopy", ctypes.c_int),
    ]
    for pattern, symbol, int_t in candidates:
        for path in sorted(glob.glob(os.path.join(libdir, pattern))):
            try:
                lib = ctypes.CDLL(path)
                fn = getattr(lib, symbol)
            except (OSError, AttributeError):
                continue
            fn.restype = None
            fn.argtypes = [int_t, ctypes.c_void_p, int_t, ctypes.c_void_p, int_t]
            if _exact(fn):
                return fn, os.path.basename(path)
    return None, "no bit-exact OpenBLAS dcopy found"


def _exact(fn: Callable[..., None]) -> bool:
    """The copy must be bitwise: a kernel that loads through x87 would quieten NaNs."""
    src = np.random.default_rng(7).integers(0, 256, 1 << 16, dtype=np.uint8)
    words = src.view(np.uint64)
    words[::3] = 0x7FF0000000000001  # signalling NaN
    words[1::7] = 0xFFF8DEADBEEF0001  # quiet NaN with payload
    dst = np.zeros_like(src)
    try:
        fn(len(words), src.ctypes.data, 1, dst.ctypes.data, 1)
    except Exception:
        return False
    return bool((src == dst).all())


def _select() -> tuple[Callable[..., None] | None, str]:
    kernel, why = choose_kernel(os.environ.get("KVMESH_COPY", ""), cpu_vendor())
    if kernel == "memmove":
        return None, f"memmove ({why})"
    fn, lib = find_dcopy()
    if fn is None:
        return None, f"memmove ({lib})"
    return fn, f"openblas dcopy ({lib}; {why})"


_dcopy, BACKEND = _select()


def copy(dst: int, src: int, n: int) -> None:
    """Copy ``n`` bytes from address ``src`` to ``dst`` (non-overlapping ranges)."""
    if _dcopy is not None and n >= _MIN_BLAS and not ((dst | src | n) & 7):
        _dcopy(n >> 3, src, 1, dst, 1)
    else:
        memmove(dst, src, n)


_CHECK_EVERY = 8 << 20  # bytes copied between two check() calls

GATE_MIN_BYTES = 256 << 10  # copy_ranges calls moving less than this never wait for a slot


def copy_slots(env: str, cpus: int) -> int:
    """How many bulk copies may run at once for ``KVMESH_COPY_THREADS=env`` (0: unbounded)."""
    env = env.strip()
    if not env:
        return max(1, cpus)
    try:
        n = int(env)
    except ValueError:
        raise ValueError(f"KVMESH_COPY_THREADS={env!r}: expected an integer >= 0") from None
    if n < 0:
        raise ValueError(f"KVMESH_COPY_THREADS={env!r}: expected an integer >= 0")
    return n


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# Bulk copies of this process run at most one per CPU, whoever calls them (the engine's workers,
# callers running their jobs inline): each thread releases the GIL for every page it copies
# and takes it back ~10-20 us later, so more copying threads than CPUs mostly trade the GIL and
# the CPUs (16 concurrent PD requests from 4 threads on 2 vCPUs: ~2,300 voluntary switches per
# round and 15 % more CPU per byte than under the gate; docs/sglang.md "16 concurrent
# requests"). Small copies (a store get of a few pages, HiCache's page reads) never wait, so
# they never queue behind bulk transfers. A slot is not handed over in FIFO order: a thread
# that is running takes a free slot before a sleeping waiter wakes up (a FIFO hand-off left a
# CPU idle at every hand-off: 10-25 % slower here), so a bulk copy waits for as long as the
# copies holding the slots keep them (one job, or one call that runs its jobs inline).
COPY_SLOTS = copy_slots(os.environ.get("KVMESH_COPY_THREADS", ""), _cpus())


class _Gate:
    def __init__(self, slots: int) -> None:
        self.sem = threading.Semaphore(slots)
        # Counted under a lock: ``+=`` on an attribute is not atomic between threads, and a
        # count that drifted up would keep bulk_busy() true for good.
        self.lock = threading.Lock()
        self.held = 0  # places taken now
        self.taken = 0  # bulk copies that took a place
        self.waited = 0  # ... of which after waiting


_gate: _Gate | None = _Gate(COPY_SLOTS) if COPY_SLOTS else None


class BulkSlot:
    """A held copy slot (context manager)."""

    __slots__ = ("_gate",)

    def __init__(self, gate: _Gate) -> None:
        self._gate = gate

    def __enter__(self) -> BulkSlot:
        return self

    def __exit__(self, *exc: object) -> None:
        gate = self._gate
        with gate.lock:
            gate.held -= 1
        gate.sem.release()


class _NoSlot:
    __slots__ = ()

    def __enter__(self) -> _NoSlot:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SLOT = _NoSlot()


def bulk_slot(nbytes: int) -> BulkSlot | _NoSlot:
    """A copy slot for a bulk CPU copy of ``nbytes`` (waits for one), or a no-op for small
    copies and when the gate is off (``KVMESH_COPY_THREADS=0``)."""
    gate = _gate
    if gate is None or nbytes < GATE_MIN_BYTES:
        return _NO_SLOT
    waited = not gate.sem.acquire(blocking=False)
    if waited:
        gate.sem.acquire()
    with gate.lock:
        gate.taken += 1
        gate.waited += waited
        gate.held += 1
    return BulkSlot(gate)


def bulk_busy() -> bool:
    """True while some bulk copy holds a slot: a new bulk batch then gains nothing from
    fanning out to worker threads (a hint: read without a lock)."""
    return _gate is not None and _gate.held > 0


def gate_stats() -> dict[str, int]:
    """Slots, slots held now, bulk copies that took one and those that waited for it."""
    g = _gate
    if g is None:
        return {"slots": 0, "held": 0, "taken": 0, "waited": 0}
    return {"slots": COPY_SLOTS, "held": g.held, "taken": g.taken, "waited": g.waited}


def copy_ranges(
    dst_base: int,
    dst_offsets: np.ndarray,
    src_base: int,
    src_offsets: np.ndarray,
    lengths: np.ndarray,
    check: Callable[[], None] | None = None,
) -> None:
    """Copy ``lengths[i]`` bytes from ``src_base + src_offsets[i]`` to
    ``dst_base + dst_offsets[i]``.

    One native call per range, GIL released, so several threads copy in parallel. ``check`` is
    called every few MiB so that a long copy stays abortable (dead peer, deadline, removed
    segment); callers cut ranges longer than that first (``transports.base.cut``).
    """
    if len(lengths) <= 4:  # numpy call overhead would dominate a few small copies
        for d, s, n in zip(dst_offsets.tolist(), src_offsets.tolist(), lengths.tolist()):
            copy(dst_base + d, src_base + s, n)
            if check is not None:
                check()
        return
    dsts = dst_offsets + np.uint64(dst_base)
    srcs = src_offsets + np.uint64(src_base)
    dst = dsts.tolist()
    src = srcs.tolist()
    lens = lengths.tolist()
    fast = _dcopy
    if (
        fast is not None
        and len(lens)
        and not (int(np.bitwise_or.reduce(dsts | srcs | lengths)) & 7)
        and int(lengths.min()) >= _MIN_BLAS
    ):
        # All aligned and large enough: the whole job goes through dcopy, counted in words.
        words = (lengths >> np.uint64(3)).tolist()
        if check is None:
            for d, s, w in zip(dst, src, words):
                fast(w, s, 1, d, 1)
            return
        budget = _CHECK_EVERY
        for d, s, w in zip(dst, src, words):
            fast(w, s, 1, d, 1)
            budget -= w << 3
            if budget <= 0:
                check()
                budget = _CHECK_EVERY
        return
    budget = _CHECK_EVERY
    for d, s, n in zip(dst, src, lens):
        copy(d, s, n)
        if check is not None:
            budget -= n
            if budget <= 0:
                check()
                budget = _CHECK_EVERY
