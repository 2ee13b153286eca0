#!/usr/bin/env python
"""Host copy kernels for scattered KV pages: which one ``kvmesh.transfer.fastcopy`` should use.

    python bench/copy_kernels.py [--quick] [--json PATH] [--pool-mib N]

Copies random pages between two pools held in ``/dev/shm`` mappings (4 KiB pages, as a
shared-memory KV pool or a peer's segment is), each page to a random slot of the other pool,
with every kernel reachable without compiling: glibc ``memmove``, NumPy's OpenBLAS ``dcopy``
and UCX's ``ucs_x86_memcpy_sse_movntdqa`` (non-temporal *loads*, ordinary stores) where the
NIXL wheel bundles it. Kernels alternate inside every repetition (same load for each), pools
are several times the last-level cache per copy pass, and every kernel's copy is verified once
outside the timed loop. Also one long contiguous copy per kernel (glibc switches to
non-temporal stores above ``x86_non_temporal_threshold``). The table reports the median GB/s
and the ratio to this run's memcpy (bench-format.md); the kernel that
``fastcopy`` selects in this process (its own probe, or ``KVMESH_COPY``) is printed first and
marked ``selected``.
"""

from __future__ import annotations

import ctypes
import glob
import mmap
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402

from kvmesh.transfer import fastcopy  # noqa: E402


def _options(ap: Any) -> None:
    ap.add_argument("--pool-mib", type=int, help="size of each pool (default 1024; quick 512)")
    ap.add_argument("--pages-kib", help="page sizes, e.g. 64,1024 (default 64,128,256,512)")


def _shm_pool(size: int) -> np.ndarray:
    name = f"/dev/shm/kvmesh-bench-kernels-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.unlink(name)  # the mapping keeps it; nothing left behind if we die
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    arr = np.frombuffer(m, np.uint8)
    arr[:] = 1  # populate every page before timing
    return arr


def _kernels() -> dict[str, Callable[[int, int, int], Any]]:
    out: dict[str, Callable[[int, int, int], Any]] = {"memmove": ctypes.memmove}
    fn, _ = fastcopy.find_dcopy()
    if fn is not None:
        out["dcopy"] = lambda d, s, n: fn(n >> 3, s, 1, d, 1)
    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "nixl_cu12.libs")
    for path in sorted(glob.glob(os.path.join(libs, "libucs-*.so*"))):
        try:
            ucs = ctypes.CDLL(path).ucs_x86_memcpy_sse_movntdqa
        except (OSError, AttributeError):
            continue
        ucs.restype = None
        ucs.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        out["ucs movntdqa"] = ucs
        break
    return out


def main() -> None:
    args = C.bench_args(__doc__.split("\n\n")[0], extra=_options)
    reps = 3 if args.quick else 7
    pool = (args.pool_mib or (512 if args.quick else 1024)) * C.MiB
    per_pass = pool // 2
    limits: dict[str, Any] = C.copy_limits()
    limits["tcp_gbps"] = None
    chosen = fastcopy.choice()  # this process's own probe (or KVMESH_COPY)
    print(f"fastcopy selects: {chosen.kernel}: {chosen.label}")
    src, dst = _shm_pool(pool), _shm_pool(pool)
    src[:] = np.random.default_rng(3).integers(0, 256, pool, dtype=np.uint8)
    sb, db = src.ctypes.data, dst.ctypes.data
    kernels = _kernels()
    rng = np.random.default_rng(1)
    sizes = (128 << 10, 512 << 10) if args.quick else (64 << 10, 128 << 10, 256 << 10, 512 << 10)
    if args.pages_kib:
        sizes = tuple(int(x) << 10 for x in args.pages_kib.split(","))
    samples: dict[tuple[str, int], list[float]] = {}
    for page in sizes:
        slots, k = pool // page, per_pass // page
        for name, fn in kernels.items():  # verified once, outside the timed loop
            so, do = rng.permutation(slots)[:k] * page, rng.permutation(slots)[:k] * page
            for d, s in zip(do[:64].tolist(), so[:64].tolist()):
                fn(db + d, sb + s, page)
            for d, s in zip(do[:64].tolist(), so[:64].tolist()):
                if not np.array_equal(dst[d : d + page], src[s : s + page]):
                    raise RuntimeError(f"{name} copied {page}-byte pages wrongly")
        for _ in range(reps):
            for name, fn in kernels.items():
                so = (rng.permutation(slots)[:k] * page + sb).tolist()
                do = (rng.permutation(slots)[:k] * page + db).tolist()
                t0 = time.perf_counter()
                for d, s in zip(do, so):
                    fn(d, s, page)
                samples.setdefault((name, page), []).append(per_pass / (time.perf_counter() - t0))
    for _ in range(reps):
        for name, fn in kernels.items():
            t0 = time.perf_counter()
            fn(db, sb, per_pass)
            samples.setdefault((name, per_pass), []).append(per_pass / (time.perf_counter() - t0))
    for name, fn in kernels.items():
        dst[:per_pass] = 0
        fn(db, sb, per_pass)
        if not np.array_equal(dst[:per_pass], src[:per_pass]):
            raise RuntimeError(f"{name} copied the contiguous run wrongly")
    C.copy_limits(limits)  # sampled again at the end: the best of both is the limit
    records = []
    for (name, page), v in samples.items():
        records.append(
            C.record(
                limits,
                "contiguous" if page == per_pass else "scattered pages",
                name,
                "copy",
                page,
                per_pass // page,
                gbps=float(np.median(v)) / 1e9,
                pool="shm",
                samples=[round(x / 1e9, 2) for x in v],
                selected=name == chosen.kernel,
            )
        )
    C.apply_ratios(records, limits)
    print(f"limits: {C.copy_limits_text(limits)}; load average {os.getloadavg()[0]:.1f}")
    C.print_table(records, (*C.FIELDS[:6], "ratio_memcpy", "ratio_copy_limit", "selected"))
    if args.json:
        C.write_json(
            args.json,
            "copy_kernels",
            limits,
            records,
            kernel=chosen.kernel,
            backend=chosen.label,
            probe_gbps=chosen.medians(),
        )


if __name__ == "__main__":
    main()
