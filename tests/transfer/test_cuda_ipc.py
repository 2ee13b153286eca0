"""CUDA IPC / NVLink transports without a GPU: clean unavailability, and the full logic
against a simulated CUDA runtime.

The simulation (``FakeCuda``) implements the handful of cuda-python calls kvmesh.transfer.cuda
uses, with "device memory" in /dev/shm files: ``cudaIpcGetMemHandle`` puts the file name in
the 64-byte handle, ``cudaIpcOpenMemHandle`` maps the file in the other process, and
``cudaMemcpyAsync`` is a memmove. So descriptors, handle export and import across real
processes, device selection, NVLink-vs-IPC reporting, reference-counted mappings and the
copies (checked byte for byte) all run for real; only the GPU is simulated. The real-GPU
versions of these tests are in test_cuda_gpu.py.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import multiprocessing as mp
import time

import numpy as np
import pytest

from kvmesh.transfer import (
    EngineConfig,
    InvalidArgument,
    MemoryKind,
    Op,
    SegmentNotFound,
    TransferEngine,
    TransportKind,
    TransportUnavailable,
    cuda,
)
from kvmesh.transfer.memory import SharedBuffer, host_array
from kvmesh.transfer.transports import cuda_ipc

POOL = 8 << 20


# --------------------------------------------------------------------------------------------
# The simulated runtime
# --------------------------------------------------------------------------------------------


class Err(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorInvalidDevice = 101
    cudaErrorInvalidContext = 201
    cudaErrorNotSupported = 801
    cudaErrorPeerAccessAlreadyEnabled = 704


class _Struct:
    """Stands for a cuda-python struct: 64 bytes reachable through getPtr()."""

    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(64)

    def getPtr(self) -> int:
        return ctypes.addressof(self._buf)


class _Uuid:
    def __init__(self, data: bytes) -> None:
        self.bytes = data


class _Props:
    def __init__(self, dev: int) -> None:
        self.uuid = _Uuid(f"fake-gpu-{dev}".encode().ljust(16, b"\0"))


class FakeCuda:
    """Runtime *and* driver module stand-in (the code under test only calls functions)."""

    cudaError_t = Err
    cudaIpcMemHandle_t = _Struct
    cudaIpcMemLazyEnablePeerAccess = 1
    cudaStreamNonBlocking = 1

    class cudaMemcpyKind(enum.IntEnum):
        cudaMemcpyDefault = 4

    def __init__(self, devices: int = 2, peer_access: bool = True) -> None:
        self.devices = devices
        self.peer_access = peer_access
        self.current = 0
        self.allocs: dict[int, SharedBuffer] = {}  # base -> buffer we allocated
        self.mapped: dict[int, SharedBuffer] = {}  # base -> buffer of another process
        self.copies: list[tuple[int, int, int, int]] = []  # (dst, src, n, device)
        self.opened = 0
        self.closed = 0
        self.vmm = False  # simulate cuMemCreate allocations (no IPC export)

    # devices
    def cudaGetDeviceCount(self):
        return (Err.cudaSuccess, self.devices)

    def cudaSetDevice(self, dev):
        if not 0 <= dev < self.devices:
            return (Err.cudaErrorInvalidDevice,)
        self.current = dev
        return (Err.cudaSuccess,)

    def cudaGetDeviceProperties(self, dev):
        return (Err.cudaSuccess, _Props(dev))

    def cudaGetErrorString(self, err):
        return (Err.cudaSuccess, f"simulated {Err(err).name}".encode())

    def cudaDeviceCanAccessPeer(self, dev, peer):
        return (Err.cudaSuccess, int(self.peer_access and dev != peer))

    def cudaDeviceEnablePeerAccess(self, peer, flags):
        return (Err.cudaSuccess,)

    def cudaPointerGetAttributes(self, ptr):
        return (Err.cudaErrorInvalidValue, None)

    # memory
    def cudaMalloc(self, n):
        buf = SharedBuffer.create(n, populate=False)
        self.allocs[buf.addr] = buf
        return (Err.cudaSuccess, buf.addr)

    def cudaFree(self, ptr):
        if int(ptr) == 0:  # the context-initialisation idiom
            return (Err.cudaSuccess,)
        buf = self.allocs.pop(int(ptr), None)
        if buf is None:
            return (Err.cudaErrorInvalidValue,)
        buf.close()
        return (Err.cudaSuccess,)

    def cuMemGetAddressRange(self, ptr):
        for table in (self.allocs, self.mapped):
            for base, buf in table.items():
                if base <= ptr < base + buf.size:
                    if self.vmm:
                        return (Err.cudaErrorNotSupported, None, None)
                    return (Err.cudaSuccess, base, buf.size)
        return (Err.cudaErrorInvalidValue, None, None)

    def cudaIpcGetMemHandle(self, base):
        buf = self.allocs.get(int(base))
        if buf is None:
            return (Err.cudaErrorInvalidValue, None)
        h = _Struct()
        ctypes.memmove(h.getPtr(), buf.name.encode(), len(buf.name))
        return (Err.cudaSuccess, h)

    def cudaIpcOpenMemHandle(self, handle, flags):
        name = ctypes.string_at(handle.getPtr(), 64).rstrip(b"\0").decode()
        if any(b.name == name for b in self.allocs.values()):
            return (Err.cudaErrorInvalidContext, None)  # CUDA refuses our own handles
        buf = SharedBuffer.attach(name)
        self.mapped[buf.addr] = buf
        self.opened += 1
        return (Err.cudaSuccess, buf.addr)

    def cudaIpcCloseMemHandle(self, ptr):
        buf = self.mapped.pop(int(ptr), None)
        if buf is None:
            return (Err.cudaErrorInvalidValue,)
        buf.close()
        self.closed += 1
        return (Err.cudaSuccess,)

    # copies
    def cudaStreamCreateWithFlags(self, flags):
        return (Err.cudaSuccess, object())

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        self.copies.append((dst, src, n, self.current))
        ctypes.memmove(dst, src, n)
        return (Err.cudaSuccess,)

    def cudaStreamSynchronize(self, stream):
        return (Err.cudaSuccess,)


def _pattern(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _sha(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a)).hexdigest()


def _owner_main(conn, device: int, vmm: bool) -> None:
    """Peer process: one engine publishing simulated GPU memory as segment "gpu"."""
    fake = FakeCuda()
    fake.vmm = vmm
    cuda._install_runtime(fake, fake)
    eng = TransferEngine(config=EngineConfig(transports_disable=[TransportKind.NIXL]))
    base = cuda.malloc(POOL + 4096, device)
    ptr = base + 4096  # a sub-range of the allocation, like torch's caching allocator
    host_array(ptr, POOL)[:] = _pattern(POOL, 21)
    eng.register_raw(ptr, POOL, MemoryKind.VRAM, device, name="gpu")
    conn.send((eng.address, eng.host_id))
    while True:
        cmd, *args = conn.recv()
        if cmd == "sha":
            off, n = args
            conn.send(_sha(host_array(ptr + off, n)))
        elif cmd == "unpublish":
            eng.unpublish("gpu")
            conn.send(True)
        elif cmd == "exit":
            eng.close()
            cuda.free(base, device)
            conn.send(True)
            return


class Owner:
    def __init__(self, device: int = 0, vmm: bool = False) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_owner_main, args=(child, device, vmm))
        self.proc.start()
        child.close()
        if not self.conn.poll(60):
            self.proc.kill()
            raise RuntimeError("owner did not start")
        self.address, self.host_id = self.conn.recv()

    def ask(self, *cmd):
        self.conn.send(cmd)
        if not self.conn.poll(30):
            raise TimeoutError(cmd)
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.ask("exit")
            except Exception:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture
def fake():
    f = FakeCuda()
    cuda._install_runtime(f, f)
    try:
        yield f
    finally:
        cuda._install_runtime(None, None)


# --------------------------------------------------------------------------------------------
# Without CUDA
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(cuda.available(), reason="this host has CUDA")
def test_unavailable_cleanly():
    assert cuda.available() is False
    reason = cuda.unavailable_reason()
    assert isinstance(reason, str) and reason
    assert cuda.device_count() == 0
    assert cuda.ordinal_of(b"x" * 16) is None
    assert cuda_ipc.CudaIpcTransport.unavailable_reason() == reason
    assert cuda_ipc.NvlinkTransport.unavailable_reason() == reason
    for call in (
        lambda: cuda.malloc(16),
        lambda: cuda.export_ipc(1, 0),
        lambda: cuda.open_ipc(b"\0" * 64, 0),
        lambda: cuda.device_uuid(0),
    ):
        with pytest.raises(TransportUnavailable):
            call()
    with TransferEngine() as eng:
        assert eng.transport_status["cuda_ipc"] == reason
        assert eng.transport_status["nvlink"] == reason
        assert TransportKind.CUDA_IPC not in eng.transports


# --------------------------------------------------------------------------------------------
# Simulated CUDA
# --------------------------------------------------------------------------------------------


def test_helpers_on_simulated_runtime(fake):
    assert cuda.available() and cuda.device_count() == 2
    assert cuda.ordinal_of(cuda.device_uuid(1)) == 1
    assert cuda.ordinal_of(b"unknown-gpu".ljust(16, b"\0")) is None
    assert cuda.can_access_peer(0, 1) and not cuda.can_access_peer(0, 0)
    base = cuda.malloc(1 << 20, 0)
    handle, off = cuda.export_ipc(base + 100, 0)
    assert len(handle) == cuda.IPC_HANDLE_SIZE and off == 100
    with pytest.raises(cuda.CudaError, match="cudaErrorInvalidContext"):
        cuda.open_ipc(handle, 0)  # our own allocation
    with pytest.raises(InvalidArgument, match="device 5 does not exist"):
        cuda.malloc(16, 5)  # a device that does not exist is refused before CUDA sees it
    # copy_runs: runs land where they should, all queued on the chosen device
    src = _pattern(1 << 20, 1)
    host_array(base, 1 << 20)[:] = src
    dst = np.zeros(1 << 20, np.uint8)
    cuda.copy_runs(
        dst.ctypes.data,
        np.array([0, 5000], np.uint64),
        base,
        np.array([4096, 0], np.uint64),
        np.array([3000, 100], np.uint64),
        1,
    )
    assert (dst[:3000] == src[4096:7096]).all() and (dst[5000:5100] == src[:100]).all()
    assert not dst[3000:5000].any()
    assert {c[3] for c in fake.copies} == {1}
    # a check() that raises stops queueing, the queued copies still complete first
    calls = []

    def stop() -> None:
        calls.append(1)
        raise TimeoutError("deadline")

    n = 600
    with pytest.raises(TimeoutError):
        cuda.copy_runs(
            dst.ctypes.data,
            np.arange(n, dtype=np.uint64),
            base,
            np.arange(n, dtype=np.uint64),
            np.ones(n, np.uint64),
            0,
            stop,
        )
    assert calls == [1] and len(fake.copies) == 2 + 256
    cuda.free(base, 0)


@pytest.mark.parametrize(
    "local_kind, local_device, peer_access, expected",
    [
        ("vram", 1, True, TransportKind.NVLINK),  # other GPU, peer access: NVLink / P2P
        ("vram", 1, False, TransportKind.CUDA_IPC),  # other GPU without peer access
        ("vram", 0, True, TransportKind.CUDA_IPC),  # same GPU as the owner
        ("dram", -1, True, TransportKind.CUDA_IPC),  # host memory on our side
    ],
)
def test_ipc_segment_transfers(fake, local_kind, local_device, peer_access, expected):
    fake.peer_access = peer_access
    owner = Owner(device=0)
    try:
        with TransferEngine(config=EngineConfig(transports_disable=[TransportKind.NIXL])) as eng:
            seg = eng.open_segment(owner.address, "gpu")
            assert seg.kind is MemoryKind.VRAM and seg.desc.cuda_ipc is not None
            assert seg.desc.cuda_ipc_offset == 4096
            if local_kind == "vram":
                base = cuda.malloc(POOL, local_device)
                local = eng.register_raw(base, POOL, MemoryKind.VRAM, local_device)
                view = host_array(base, POOL)
            else:
                view = np.zeros(POOL, np.uint8)
                local = eng.register(view)
            page = 64 << 10
            n = POOL // page
            perm = np.random.default_rng(2).permutation(n)
            res = eng.transfer(Op.READ, local, perm * page, seg, np.arange(n) * page, page)
            assert res.transports == [expected]
            want = _pattern(POOL, 21).reshape(n, page)
            assert _sha(view.reshape(n, page)[perm]) == _sha(want)
            dev = local_device if local_kind == "vram" else 0
            assert {c[3] for c in fake.copies} == {dev}
            # WRITE 16 KiB pages; adjacent pages travel as one copy
            fake.copies.clear()
            small = 16 << 10
            view[: 64 * small] = _pattern(64 * small, 3)
            dst = np.concatenate((np.arange(32) + 100, np.arange(32) + 300)) * small
            res = eng.transfer(Op.WRITE, local, np.arange(64) * small, seg, dst, small)
            assert res.transports == [expected]
            assert len(fake.copies) == 2, "contiguous pages were not coalesced"
            assert owner.ask("sha", 100 * small, 32 * small) == _sha(view[: 32 * small])
            assert owner.ask("sha", 300 * small, 32 * small) == _sha(view[32 * small : 64 * small])
            assert cuda.open_mappings() == 1
            # the owner unpublishes: the route closes and the mapping goes away
            owner.ask("unpublish")
            with pytest.raises(SegmentNotFound):
                eng.open_segment(owner.address, "gpu", refresh=True)
            end = time.monotonic() + 10  # the removal notice arrives asynchronously
            while seg.stale_reason is None and time.monotonic() < end:
                time.sleep(0.01)
            with pytest.raises(SegmentNotFound):
                eng.transfer(Op.READ, local, [0], seg, [0], [16])
            while fake.closed == 0 and time.monotonic() < end:  # closed right after
                time.sleep(0.01)
            assert cuda.open_mappings() == 0 and fake.closed == fake.opened == 1
    finally:
        owner.close()


def test_same_process_and_unexportable_memory(fake):
    with TransferEngine(config=EngineConfig(transports_disable=[TransportKind.NIXL])) as eng:
        base = cuda.malloc(1 << 20, 0)
        region = eng.register_raw(base, 1 << 20, MemoryKind.VRAM, 0, name="mine")
        desc = eng.segments()[0]
        assert desc.cuda_ipc is not None and desc.extra["cuda_uuid"] == cuda.device_uuid(0)
        tr = eng.transport(TransportKind.CUDA_IPC)
        assert not tr.can_serve(region, desc), "CUDA cannot open this process's own handles"
        eng.unregister(region)
        cuda.free(base, 0)
    # An allocation CUDA IPC cannot export (VMM): no handle, so not served by CUDA IPC.
    owner = Owner(device=0, vmm=True)
    try:
        with TransferEngine(config=EngineConfig(transports_disable=[TransportKind.NIXL])) as eng:
            seg = eng.open_segment(owner.address, "gpu")
            assert seg.desc.cuda_ipc is None
            local = eng.register(np.zeros(4096, np.uint8))
            with pytest.raises(TransportUnavailable):
                eng.transfer(Op.READ, local, [0], seg, [0], [4096])
    finally:
        owner.close()


def test_device_not_visible(fake):
    """A segment on a GPU this process cannot see is not CUDA IPC's to serve."""
    owner = Owner(device=1)
    try:
        fake.devices = 1  # e.g. CUDA_VISIBLE_DEVICES hides the owner's GPU from us
        cuda._install_runtime(fake, fake)
        with TransferEngine(config=EngineConfig(transports_disable=[TransportKind.NIXL])) as eng:
            seg = eng.open_segment(owner.address, "gpu")
            local = eng.register(np.zeros(4096, np.uint8))
            assert not eng.transport(TransportKind.CUDA_IPC).can_serve(local, seg.desc)
    finally:
        owner.close()
