#!/usr/bin/env python
"""Do several ``process_vm_writev`` streams into one process scale on this box? (issue 9, B)

    python bench/cma_streams.py [--mib 512] [--rounds 3]

A child process maps ``--mib`` MiB and sleeps; this process writes the same amount into it with
``process_vm_writev`` (ctypes, GIL released) from 1, 2 and 4 threads, each thread one
contiguous share in 128 KiB iovecs (a PD page of one layer), interleaved with a single-thread
memcpy of the same size (the reference). Prints GB/s per round and the ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import threading
import time

import numpy as np

libc = ctypes.CDLL(None, use_errno=True)


class IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


libc.process_vm_writev.restype = ctypes.c_ssize_t
libc.process_vm_writev.argtypes = [
    ctypes.c_int,
    ctypes.POINTER(IOVec),
    ctypes.c_ulong,
    ctypes.POINTER(IOVec),
    ctypes.c_ulong,
    ctypes.c_ulong,
]
CHILD = (
    "import mmap,sys,ctypes;m=mmap.mmap(-1,int(sys.argv[1]));m.write(b'\\0'*len(m));"
    "print(ctypes.addressof(ctypes.c_char.from_buffer(m)),flush=True);sys.stdin.read()"
)
BLOCK = 128 << 10


def write_share(pid: int, src: int, dst: int, n: int) -> None:
    per = 1024  # IOV_MAX
    for off in range(0, n, per * BLOCK):
        k = min(per, (n - off) // BLOCK)
        lv = (IOVec * k)(*[IOVec(src + off + i * BLOCK, BLOCK) for i in range(k)])
        rv = (IOVec * k)(*[IOVec(dst + off + i * BLOCK, BLOCK) for i in range(k)])
        if libc.process_vm_writev(pid, lv, k, rv, k, 0) != k * BLOCK:
            raise OSError(ctypes.get_errno(), "process_vm_writev")


def streams(pid: int, src: int, dst: int, n: int, threads: int) -> float:
    share = n // threads
    ts = [
        threading.Thread(target=write_share, args=(pid, src + i * share, dst + i * share, share))
        for i in range(threads)
    ]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return n / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    n = a.mib << 20
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    dst = int(child.stdout.readline())
    src = np.ones(n, np.uint8)
    ref = np.zeros(n, np.uint8)
    np.copyto(ref, src)  # fault its pages in before timing
    print(f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.1f}, {a.mib} MiB, 128 KiB iovecs")
    try:
        streams(child.pid, src.ctypes.data, dst, n, 1)  # warm the child's pages
        for r in range(a.rounds):
            t0 = time.perf_counter()
            np.copyto(ref, src)
            mem = n / (time.perf_counter() - t0) / 1e9
            row = {k: streams(child.pid, src.ctypes.data, dst, n, k) for k in (1, 2, 4)}
            print(
                f"round {r}: memcpy {mem:.2f} GB/s; cma "
                + ", ".join(f"{k} thr {v:.2f} ({v / mem:.2f} x memcpy)" for k, v in row.items())
                + f"; 2 thr / 1 thr {row[2] / row[1]:.2f}, 4 / 1 {row[4] / row[1]:.2f}"
            )
    finally:
        child.kill()
        child.wait()


if __name__ == "__main__":
    main()
