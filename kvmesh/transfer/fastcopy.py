"""The fastest host-memory copy reachable from Python without compiling anything.

Two kernels are reachable, both bit-exact and both releasing the GIL:

* ``memmove`` (glibc): between ~2 KiB and its non-temporal threshold it copies with
  ``rep movsb``;
* OpenBLAS ``dcopy`` from NumPy's bundled OpenBLAS, a plain SIMD loop.

Which one is faster depends on the CPU, not on its vendor alone: ``rep movsb`` ran 3-4x slower
than the SIMD loop from 4 KiB-page sources on the AMD EPYC VM this was first built on, 1.1-1.45x
*faster* on an Intel Xeon, and within ±15 % of it on a later EPYC (docs/transfer.md, "Copies:
which kernel"). So the kernel is chosen by measuring both, once per process, at the first copy
or engine start (:func:`choice`): a ~10 ms probe on the shapes kvmesh copies, and ``dcopy``
only when it is clearly faster (:func:`decide`). ``KVMESH_COPY=memmove`` or ``KVMESH_COPY=dcopy``
forces one and skips the probe. ``dcopy`` is used only after a bit-exact check (NaN payloads
included), for 8-byte aligned blocks of at least ``_MIN_BLAS`` bytes. No kernel with
non-temporal stores is reachable without compiling (none of the bundled libraries exports
one: docs/transfer.md), so scattered pages copy through the cache either way.
"""

from __future__ import annotations

import ctypes
import glob
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

memmove = ctypes.memmove
_MIN_BLAS = 2048  # below this glibc does not use rep movsb anyway and call overhead dominates

KERNELS = ("memmove", "dcopy")
DEFAULT_KERNEL = "memmove"  # what a near tie keeps: glibc's, needs nothing else to be found
# dcopy must beat memmove by this factor (geometric mean over the probe's shapes) to be chosen.
# Interleaved medians of the probe still move by ~10 % between runs on a shared 2-vCPU VM
# (docs/transfer.md): without a margin a near tie would flip from one process to the next.
TIE_MARGIN = 1.15

# The probe's shapes, as (label, block bytes): the store's and HiCache's scattered pages, and
# MiB-sized contiguous runs (a store object, a PD layer chunk), each to a random slot.
PROBE_SHAPES = (
    ("128 KiB pages", 128 << 10),
    ("512 KiB pages", 512 << 10),
    ("2 MiB runs", 2 << 20),
)
_PROBE_POOL = 4 << 20  # each side; a shared-memory file in 4 KiB pages, as a segment is
_PROBE_REPS = 5  # timed rounds per kernel and shape, interleaved, after one warm-up round


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


def forced_kernel(env: str) -> str | None:
    """The kernel ``KVMESH_COPY=env`` forces, or None for ``auto`` (measure)."""
    env = env.strip().lower()
    if env in KERNELS:
        return env
    if env not in ("", "auto"):
        raise ValueError(f"KVMESH_COPY={env!r}: expected memmove, dcopy or auto")
    return None


def decide(
    samples: Mapping[str, Mapping[str, Sequence[float]]], margin: float = TIE_MARGIN
) -> tuple[str, str]:
    """``(kernel, reason)`` from probe samples: ``samples[shape][kernel]`` lists GB/s, one
    figure per round, the kernels of a round measured back to back.

    Pure. Per shape, the median over rounds of dcopy's figure over memmove's of the same round
    (a pair sees the same load, so a busy neighbour slows both); then the geometric mean over
    shapes. ``dcopy`` only at ``margin`` or above; anything closer, or a shape missing a
    kernel, keeps :data:`DEFAULT_KERNEL`, so the choice does not flip with the noise of a
    shared machine.
    """
    logs = []
    for shape, by_kernel in samples.items():
        pairs = [
            d / m
            for m, d in zip(by_kernel.get("memmove", ()), by_kernel.get("dcopy", ()))
            if m > 0 and d > 0
        ]
        if not pairs:
            return DEFAULT_KERNEL, f"no figures for {shape}"
        logs.append(math.log(float(np.median(pairs))))
    if not logs:
        return DEFAULT_KERNEL, "nothing measured"
    ratio = math.exp(sum(logs) / len(logs))
    if ratio >= margin:
        return "dcopy", f"measured: dcopy {ratio:.2f}x memmove"
    if ratio > 1 / margin:
        return DEFAULT_KERNEL, f"measured: dcopy {ratio:.2f}x memmove, a near tie keeps memmove"
    return "memmove", f"measured: dcopy {ratio:.2f}x memmove"


def _probe_pool(size: int) -> tuple[mmap.mmap, int]:
    # memfd: shared memory in 4 KiB pages like a /dev/shm segment, and no file left behind.
    fd = os.memfd_create("kvmesh-copy-probe", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    view = np.frombuffer(m, np.uint8)
    view[:: mmap.PAGESIZE] = 1  # every page present before timing (MAP_POPULATE may be absent)
    addr = view.ctypes.data
    del view
    return m, addr


def probe(dcopy: Callable[..., None], reps: int = _PROBE_REPS) -> dict[str, dict[str, list[float]]]:
    """GB/s samples of memmove and ``dcopy`` per :data:`PROBE_SHAPES` shape (``decide``'s
    input). Kernels alternate inside every round, so load changes hit both alike."""
    kernels: dict[str, Callable[[int, int, int], object]] = {
        "memmove": memmove,
        "dcopy": lambda d, s, n: dcopy(n >> 3, s, 1, d, 1),
    }
    pool = _PROBE_POOL
    per_sample = 2 << 20
    src_map, src = _probe_pool(pool)
    dst_map, dst = _probe_pool(pool)
    rng = np.random.default_rng()
    order = list(kernels.items())
    out: dict[str, dict[str, list[float]]] = {s[0]: {k: [] for k in kernels} for s in PROBE_SHAPES}
    try:
        for rnd in range(reps + 1):  # round 0 warms caches and TLBs up
            for label, page in PROBE_SHAPES:
                k, slots = per_sample // page, pool // page
                for name, fn in order if rnd % 2 else order[::-1]:  # neither always first
                    so = (rng.permutation(slots)[:k] * page + src).tolist()
                    do = (rng.permutation(slots)[:k] * page + dst).tolist()
                    t0 = time.perf_counter()
                    for d, s in zip(do, so):
                        fn(d, s, page)
                    dt = time.perf_counter() - t0
                    if rnd:
                        out[label][name].append(round(per_sample / max(dt, 1e-9) / 1e9, 2))
    finally:
        src_map.close()
        dst_map.close()
    return out


@dataclass(frozen=True)
class Choice:
    """The copy kernel of this process and why (``kvmesh info`` prints it)."""

    kernel: str  # one of KERNELS: the identifier benches and tests compare against
    reason: str
    library: str | None = None  # dcopy's OpenBLAS library, when it was found
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # GB/s, by shape
    probe_ms: float | None = None

    @property
    def label(self) -> str:
        if self.kernel == "dcopy":
            return f"openblas dcopy ({self.library}; {self.reason})"
        return f"memmove ({self.reason})"

    def medians(self) -> dict[str, dict[str, float]]:
        return {
            shape: {k: round(float(np.median(v)), 2) for k, v in by.items() if v}
            for shape, by in self.samples.items()
        }


def _select(env: str) -> tuple[Callable[..., None] | None, Choice]:
    forced = forced_kernel(env)
    if forced == "memmove":
        return None, Choice("memmove", "KVMESH_COPY")
    fn, lib = find_dcopy()
    if fn is None:
        return None, Choice("memmove", lib)
    if forced == "dcopy":
        return fn, Choice("dcopy", "KVMESH_COPY", lib)
    t0 = time.perf_counter()
    samples = probe(fn)
    ms = (time.perf_counter() - t0) * 1e3
    kernel, why = decide(samples)
    return (fn if kernel == "dcopy" else None), Choice(kernel, why, lib, samples, round(ms, 1))


_dcopy: Callable[..., None] | None = None  # the chosen kernel when it is dcopy
_chosen: Choice | None = None
_choose_lock = threading.Lock()


def _choose() -> Callable[..., None] | None:
    global _dcopy, _chosen
    with _choose_lock:
        if _chosen is None:
            _dcopy, _chosen = _select(os.environ.get("KVMESH_COPY", ""))
    return _dcopy


def choice() -> Choice:
    """This process's copy kernel, measured on first use and kept for the process."""
    if _chosen is None:
        _choose()
    assert _chosen is not None
    return _chosen


def copy(dst: int, src: int, n: int) -> None:
    """Copy ``n`` bytes from address ``src`` to ``dst`` (non-overlapping ranges)."""
    fast = _dcopy if _chosen is not None else _choose()
    if fast is not None and n >= _MIN_BLAS and not ((dst | src | n) & 7):
        fast(n >> 3, src, 1, dst, 1)
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
    fast = _dcopy if _chosen is not None else _choose()
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
    if (fast is None or int(lengths.max()) < _MIN_BLAS) and (
        check is None or int(lengths.sum()) < _CHECK_EVERY
    ):
        # Every range a plain memmove and no check due: one C-level map over the ranges
        # (HiCache's layer_first pages: thousands of 1-8 KiB ranges, where a Python call
        # per range cost 2-3x the copying; tests/transfer/test_fastcopy.py).
        for _ in map(memmove, dst, src, lens):
            pass
        return
    budget = _CHECK_EVERY
    for d, s, n in zip(dst, src, lens):
        copy(d, s, n)
        if check is not None:
            budget -= n
            if budget <= 0:
                check()
                budget = _CHECK_EVERY
