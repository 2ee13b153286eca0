"""GPU paths on real CUDA: IPC handles across processes, the CUDA IPC / NVLink transports,
NIXL VRAM registration, GPU copy bandwidth. Skipped cleanly without CUDA.

Allocations use kvmesh.transfer.cuda.malloc (cuda-python), so torch's CUDA build is only
needed by the tensor test. scripts/gpu_check.sh runs this file on a GPU machine.
"""

from __future__ import annotations

import faulthandler
import hashlib
import multiprocessing as mp
import os
import tempfile
import time
import traceback
import weakref

import numpy as np
import pytest

from kvmesh.transfer import EngineConfig, MemoryKind, Op, TransferEngine, TransportKind, cuda
from kvmesh.transfer import nixl as na

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda.available(), reason=f"CUDA: {cuda.unavailable_reason()}"),
]

SIZE = 64 << 20


def _pattern(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _sha(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a)).hexdigest()


def _to_host(ptr: int, n: int, device: int) -> np.ndarray:
    out = np.empty(n, np.uint8)
    cuda.copy(out.ctypes.data, ptr, n, device)
    return out


def _child_ipc(conn, device: int) -> None:
    """Allocate, fill and export GPU memory; verify what the parent wrote into it."""
    base = cuda.malloc(SIZE + 8192, device)
    ptr = base + 8192
    src = _pattern(SIZE, 1)
    cuda.copy(ptr, src.ctypes.data, SIZE, device)
    handle, offset = cuda.export_ipc(ptr, device)
    conn.send((handle, offset, cuda.device_uuid(device)))
    cmd = conn.recv()
    assert cmd == "check"
    conn.send(_sha(_to_host(ptr, SIZE, device)))
    conn.recv()
    cuda.free(base, device)


def _child_engine(conn, device: int) -> None:
    """A peer engine publishing GPU memory as segment "gpu" (NIXL off: CUDA paths only)."""
    eng = TransferEngine(config=EngineConfig(transports_disable=[TransportKind.NIXL]))
    base = cuda.malloc(SIZE, device)
    cuda.copy(base, _pattern(SIZE, 2).ctypes.data, SIZE, device)
    eng.register_raw(base, SIZE, MemoryKind.VRAM, device, name="gpu")
    conn.send(eng.address)
    while True:
        cmd = conn.recv()
        if cmd == "sha":
            conn.send(_sha(_to_host(base, SIZE, device)))
        else:
            eng.close()
            cuda.free(base, device)
            conn.send(True)
            return


def _child_main(target, report: str, conn, *args) -> None:
    """Run ``target`` in the spawned child with its native crash stack (faulthandler) and any
    Python traceback written to ``report``, which the parent shows if the child dies first:
    the first H200 run lost both (the cuda_ipc children died without a word)."""
    with open(report, "w") as f:
        faulthandler.enable(file=f, all_threads=True)
        try:
            target(conn, *args)
        except BaseException:
            traceback.print_exc(file=f)
            f.flush()
            raise


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    fd, report = tempfile.mkstemp(prefix="kvmesh-gpu-child-", suffix=".txt")
    os.close(fd)
    proc = ctx.Process(target=_child_main, args=(target, report, child, *args))
    proc.report = report
    weakref.finalize(proc, os.unlink, report)
    proc.start()
    child.close()
    assert parent.poll(120), "GPU child did not start"
    return proc, parent


def _first(conn, proc):
    """The child's first message; if it died first, its exit code (a negative one is the
    signal that killed it) and what it wrote to its report (a native crash's stack)."""
    try:
        return conn.recv()
    except EOFError:
        proc.join(30)
        with open(proc.report) as f:
            said = f.read().strip() or "(nothing)"
        raise AssertionError(
            f"GPU child died before answering: exit code {proc.exitcode}; its report:\n{said}"
        ) from None


def test_ipc_handle_across_processes():
    proc, conn = _spawn(_child_ipc, 0)
    try:
        handle, offset, uuid = _first(conn, proc)
        assert offset == 8192 and len(handle) == cuda.IPC_HANDLE_SIZE
        dev = cuda.ordinal_of(uuid)
        assert dev is not None
        base = cuda.open_ipc(handle, dev)
        assert cuda.open_ipc(handle, dev) == base  # cached, reference counted
        got = _to_host(base + offset, SIZE, dev)
        assert _sha(got) == _sha(_pattern(SIZE, 1))
        new = _pattern(SIZE, 3)
        cuda.copy(base + offset, new.ctypes.data, SIZE, dev)
        conn.send("check")
        assert conn.recv() == _sha(new)
        cuda.close_ipc(handle)
        cuda.close_ipc(handle)
        assert cuda.open_mappings() == 0
        conn.send("bye")
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("local", ["vram", "dram"])
def test_cuda_ipc_transport(local):
    proc, conn = _spawn(_child_engine, 0)
    try:
        address = _first(conn, proc)
        with TransferEngine(config=EngineConfig(transports_disable=[TransportKind.NIXL])) as eng:
            seg = eng.open_segment(address, "gpu")
            assert seg.desc.cuda_ipc is not None
            if local == "vram":
                lbase = cuda.malloc(SIZE, 0)
                region = eng.register_raw(lbase, SIZE, MemoryKind.VRAM, 0)
            else:
                host = np.zeros(SIZE, np.uint8)
                region = eng.register(host)
            page = 256 << 10
            n = SIZE // page
            perm = np.random.default_rng(5).permutation(n)
            res = eng.transfer(Op.READ, region, perm * page, seg, np.arange(n) * page, page)
            assert res.transports == [TransportKind.CUDA_IPC]
            got = _to_host(lbase, SIZE, 0) if local == "vram" else host
            assert _sha(got.reshape(n, page)[perm]) == _sha(_pattern(SIZE, 2).reshape(n, page))
            res = eng.transfer(
                Op.WRITE, region, np.arange(n) * page, seg, np.arange(n) * page, page
            )
            assert res.transports == [TransportKind.CUDA_IPC]
            conn.send("sha")
            assert conn.recv() == _sha(got)
            if local == "vram":
                eng.unregister(region)
                cuda.free(lbase, 0)
        conn.send("exit")
        conn.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


@pytest.mark.skipif(
    cuda.device_count() < 2 or not cuda.can_access_peer(1, 0),
    reason="needs two GPUs with peer access",
)
def test_nvlink_transport():
    proc, conn = _spawn(_child_engine, 0)
    try:
        address = _first(conn, proc)
        with TransferEngine(config=EngineConfig(transports_disable=[TransportKind.NIXL])) as eng:
            seg = eng.open_segment(address, "gpu")
            lbase = cuda.malloc(SIZE, 1)
            region = eng.register_raw(lbase, SIZE, MemoryKind.VRAM, 1)
            res = eng.transfer(Op.READ, region, [0], seg, [0], [SIZE])
            assert res.transports == [TransportKind.NVLINK]
            assert _sha(_to_host(lbase, SIZE, 1)) == _sha(_pattern(SIZE, 2))
            eng.unregister(region)
            cuda.free(lbase, 1)
        conn.send("exit")
        conn.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


@pytest.mark.skipif(not na.available(), reason="NIXL is not installed")
def test_nixl_vram_registration():
    a = na.NixlAgent("gpu-a")
    b = na.NixlAgent("gpu-b")
    try:
        vram = cuda.malloc(SIZE, 0)
        src = _pattern(SIZE, 4)
        cuda.copy(vram, src.ctypes.data, SIZE, 0)
        host = np.zeros(SIZE, np.uint8)
        rv = a.register(vram, SIZE, "VRAM", 0)
        rh = b.register(host.ctypes.data, SIZE)
        peer = a.add_remote(b.metadata())
        a.transfer("WRITE", rv, [0], peer, rh.remote(), [0], [SIZE], timeout=60)
        assert _sha(host) == _sha(src)
        a.deregister(rv)
        cuda.free(vram, 0)
    finally:
        a.close()
        b.close()


def test_gpu_copy_bandwidth():
    """Host->device, device->host and device->device copies: correct, and their GB/s printed."""
    dev_a = cuda.malloc(SIZE, 0)
    dev_b = cuda.malloc(SIZE, 0)
    host = _pattern(SIZE, 6)
    back = np.zeros(SIZE, np.uint8)
    rates = {}
    for name, (dst, src) in {
        "h2d": (dev_a, host.ctypes.data),
        "d2d": (dev_b, dev_a),
        "d2h": (back.ctypes.data, dev_b),
    }.items():
        cuda.copy(dst, src, SIZE, 0)  # warm-up
        t0 = time.perf_counter()
        for _ in range(5):
            cuda.copy(dst, src, SIZE, 0)
        rates[name] = 5 * SIZE / (time.perf_counter() - t0) / 1e9
    assert _sha(back) == _sha(host)
    print("GPU copy GB/s (pageable host memory):", {k: round(v, 1) for k, v in rates.items()})
    cuda.free(dev_a, 0)
    cuda.free(dev_b, 0)
