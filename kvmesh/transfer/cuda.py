"""Thin CUDA runtime helpers for the GPU transports, over cuda-python (imported lazily).

Importable everywhere: without cuda-python, a driver or a device, :func:`available` is False
and :func:`unavailable_reason` says why; nothing here raises at import time.

What the transports need and nothing more:

* device identity across processes (:func:`device_uuid`, :func:`ordinal_of`): device
  ordinals differ between processes (``CUDA_VISIBLE_DEVICES``), UUIDs do not;
* CUDA IPC: :func:`export_ipc` finds the ``cudaMalloc`` allocation that holds a pointer
  (``cuMemGetAddressRange``; the torch caching allocator hands out sub-ranges of big blocks)
  and exports a 64-byte ``cudaIpcMemHandle_t`` for it plus the pointer's offset inside;
  :func:`open_ipc` maps a peer's handle once per process (reference counted: CUDA refuses to
  open the same handle twice in one context) and :func:`close_ipc` unmaps it;
* peer access (NVLink/PCIe P2P) between two devices: :func:`can_access_peer`;
* what memory is at a pointer (:func:`memory_kind`, exported as
  ``kvmesh.transfer.memory_kind``): for callers that get raw addresses without a kind (the
  Mooncake transfer API of the SGLang PD plugin);
* batched copies: :func:`copy_runs` queues one ``cudaMemcpyAsync(cudaMemcpyDefault)`` per
  run on a per-thread, per-device stream and synchronises once.

Allocations made with the CUDA virtual memory API (``cuMemCreate``; torch with
``expandable_segments:True``) cannot be exported with ``cudaIpcGetMemHandle``:
:func:`export_ipc` raises :class:`CudaError` and the segment is then served by NIXL instead.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import InvalidArgument, TransferError, TransportUnavailable
from .types import MemoryKind

__all__ = [
    "CudaError",
    "IPC_HANDLE_SIZE",
    "available",
    "can_access_peer",
    "close_ipc",
    "copy",
    "copy_runs",
    "device_count",
    "device_uuid",
    "export_ipc",
    "free",
    "malloc",
    "memory_kind",
    "open_ipc",
    "ordinal_of",
    "pointer_device",
    "unavailable_reason",
]

log = logging.getLogger("kvmesh.transfer")

IPC_HANDLE_SIZE = 64  # sizeof(cudaIpcMemHandle_t)


class CudaError(TransferError):
    """A CUDA runtime or driver call failed."""

    code = "transfer"


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

_lock = threading.RLock()
_rt: Any = None
_drv: Any = None
_reason: str | None = None
_tried = False
_count = 0
# Device nodes of the NVIDIA driver (Linux; /dev/dxg under WSL2).
_DEVICE_NODES = ("/dev/nvidiactl", "/dev/dxg")


def _import_bindings() -> tuple[Any, Any]:
    try:
        from cuda.bindings import driver, runtime  # cuda-python >= 12.6

        return runtime, driver
    except ImportError:
        pass
    from cuda import cuda as driver  # type: ignore[no-redef]  # older cuda-python
    from cuda import cudart as runtime  # type: ignore[no-redef]

    return runtime, driver


def _load() -> bool:
    global _rt, _drv, _reason, _tried, _count
    if _tried:
        return _rt is not None
    with _lock:
        if _tried:
            return _rt is not None
        if not any(os.path.exists(p) for p in _DEVICE_NODES):
            # Cheap answer for CPU-only hosts: no need to import cuda-python (~0.3 s).
            _reason = "no NVIDIA GPU on this host (no " + " or ".join(_DEVICE_NODES) + ")"
            _tried = True
            return False
        try:
            rt, drv = _import_bindings()
        except Exception as exc:
            _reason = f"cuda-python is not installed ({type(exc).__name__}: {exc})"
            _tried = True
            return False
        try:
            res = rt.cudaGetDeviceCount()
            err, count = res[0], res[1]
            if int(err) != 0:
                _reason = f"no usable CUDA driver or device ({_err_text(rt, err)})"
            elif not count:
                _reason = "no CUDA device"
            else:
                _rt, _drv, _count = rt, drv, int(count)
        except Exception as exc:  # a broken driver install must not break imports
            _reason = f"CUDA probe failed: {type(exc).__name__}: {exc}"
        _tried = True
        return _rt is not None


def _install_runtime(runtime: Any, driver: Any) -> None:
    """Use these runtime/driver modules instead of cuda-python (tests inject a simulation).

    ``None`` resets to "not probed yet".
    """
    global _rt, _drv, _reason, _tried, _count
    with _lock:
        _close_all()
        if runtime is None:
            _rt = _drv = None
            _reason, _tried, _count = None, False, 0
            return
        _rt, _drv, _tried, _reason = runtime, driver, True, None
        _count = int(runtime.cudaGetDeviceCount()[1])
        _peer_cache.clear()
        _uuid_cache.clear()


def available() -> bool:
    """Whether CUDA can be used here (cuda-python, a driver and at least one device)."""
    try:
        return _load()
    except Exception:  # pragma: no cover - defensive
        return False


def unavailable_reason() -> str | None:
    """``None`` when CUDA is usable, else why not."""
    return None if available() else (_reason or "CUDA is not available")


def _api() -> Any:
    if not _load():
        raise TransportUnavailable(_reason or "CUDA is not available")
    return _rt


def device_count() -> int:
    """Number of CUDA devices visible to this process (0 without CUDA)."""
    return _count if available() else 0


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def _err_text(rt: Any, err: Any) -> str:
    name = getattr(err, "name", str(err))
    try:
        res = rt.cudaGetErrorString(err)
        msg = res[1] if isinstance(res, tuple) else res
        if isinstance(msg, bytes):
            msg = msg.decode(errors="replace")
        return f"{name}: {msg}"
    except Exception:
        return str(name)


def _check(res: Any, what: str) -> Any:
    """Unpack a cuda-python result ``(err, *values)``; raise :class:`CudaError` on failure."""
    if isinstance(res, tuple):
        err, vals = res[0], res[1:]
    else:
        err, vals = res, ()
    if int(err) != 0:
        raise CudaError(f"{what}: {_err_text(_rt, err)}")
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else vals


def _set_device(device: int) -> None:
    if not 0 <= device < _count:
        raise InvalidArgument(f"CUDA device {device} does not exist here ({_count} visible)")
    _check(_rt.cudaSetDevice(device), f"cudaSetDevice({device})")


# --------------------------------------------------------------------------------------------
# Devices and pointers
# --------------------------------------------------------------------------------------------

_uuid_cache: dict[int, bytes] = {}
_peer_cache: dict[tuple[int, int], bool] = {}


def device_uuid(device: int) -> bytes:
    """A 16-byte identity of ``device`` valid in every process of the host."""
    rt = _api()
    got = _uuid_cache.get(device)
    if got is None:
        if not 0 <= device < _count:
            raise InvalidArgument(f"CUDA device {device} does not exist here ({_count} visible)")
        props = _check(rt.cudaGetDeviceProperties(device), f"cudaGetDeviceProperties({device})")
        got = _uuid_cache[device] = bytes(props.uuid.bytes)[:16]
    return got


def ordinal_of(uuid: bytes) -> int | None:
    """This process's ordinal of the device with ``uuid``, or None if it is not visible."""
    if not available():
        return None
    for dev in range(_count):
        if device_uuid(dev) == bytes(uuid):
            return dev
    return None


def pointer_device(ptr: int) -> int | None:
    """The device holding ``ptr`` if it is device memory, else None (host or unknown)."""
    rt = _api()
    res = rt.cudaPointerGetAttributes(ptr)
    if int(res[0]) != 0:
        return None
    attrs = res[1]
    kind = getattr(attrs.type, "name", str(attrs.type))
    return int(attrs.device) if kind.endswith("Device") or kind.endswith("Managed") else None


class _CudaPointerAttributes(ctypes.Structure):
    # cudaPointerAttributes since CUDA 11: type, device, devicePointer, hostPointer.
    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("devicePointer", ctypes.c_void_p),
        ("hostPointer", ctypes.c_void_p),
    ]


def _cudart_probe() -> Callable[[int], int | None] | None:
    """``ptr -> device or None`` through the CUDA runtime torch already loaded, or None: a
    process with torch's CUDA but no cuda-python still tells device memory from host memory."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_available():
            return None
    except Exception:
        return None
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"):
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cudaPointerGetAttributes
            break
        except (OSError, AttributeError):
            continue
    else:
        return None
    fn.argtypes = [ctypes.POINTER(_CudaPointerAttributes), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    clear = getattr(lib, "cudaGetLastError", None)

    def probe(ptr: int) -> int | None:
        attrs = _CudaPointerAttributes()
        if fn(ctypes.byref(attrs), ctypes.c_void_p(ptr)) != 0:
            if clear is not None:
                clear()  # an unknown pointer leaves an error behind; drop it
            return None
        return int(attrs.device) if attrs.type in (2, 3) else None  # device, managed

    return probe


_probe_lock = threading.Lock()
_probe: Any = False  # False: not chosen yet; None: no CUDA here (every pointer is host memory)


def memory_kind(ptr: int) -> tuple[MemoryKind, int]:
    """``(kind, device)`` of the memory at ``ptr``, for ``register_raw``: ``(VRAM, device)``
    for CUDA device or managed memory, ``(DRAM, -1)`` for anything else (every pointer, on a
    host without CUDA). CUDA pointer attributes through cuda-python, else through the CUDA
    runtime torch loaded."""
    global _probe
    if _probe is False:
        with _probe_lock:
            if _probe is False:
                _probe = pointer_device if available() else _cudart_probe()
    if _probe is None:
        return MemoryKind.DRAM, -1
    dev = _probe(ptr)
    return (MemoryKind.DRAM, -1) if dev is None else (MemoryKind.VRAM, int(dev))


def can_access_peer(device: int, peer: int) -> bool:
    """Whether ``device`` can read/write ``peer``'s memory directly (NVLink or PCIe P2P)."""
    if device == peer:
        return False
    rt = _api()
    key = (device, peer)
    got = _peer_cache.get(key)
    if got is None:
        got = bool(
            _check(
                rt.cudaDeviceCanAccessPeer(device, peer),
                f"cudaDeviceCanAccessPeer({device}, {peer})",
            )
        )
        if got:
            _set_device(device)
            err = rt.cudaDeviceEnablePeerAccess(peer, 0)
            err = err[0] if isinstance(err, tuple) else err
            # "already enabled" is fine (another thread, torch, or an earlier call did it)
            if int(err) not in (0, int(rt.cudaError_t.cudaErrorPeerAccessAlreadyEnabled)):
                log.warning(
                    "cudaDeviceEnablePeerAccess(%d -> %d): %s", device, peer, _err_text(rt, err)
                )
                got = False
        _peer_cache[key] = got
    return got


# --------------------------------------------------------------------------------------------
# IPC
# --------------------------------------------------------------------------------------------


def export_ipc(ptr: int, device: int) -> tuple[bytes, int]:
    """``(handle, offset)``: the IPC handle of the allocation holding ``ptr`` on ``device``."""
    rt = _api()
    _set_device(device)
    # The driver API below needs the device's primary context current in this thread.
    _check(rt.cudaFree(0), "cudaFree(0) (context initialisation)")
    base, _size = _check(_drv.cuMemGetAddressRange(ptr), f"cuMemGetAddressRange(0x{ptr:x})")
    base = int(base)
    handle = _check(rt.cudaIpcGetMemHandle(base), f"cudaIpcGetMemHandle(0x{base:x})")
    data = ctypes.string_at(handle.getPtr(), IPC_HANDLE_SIZE)
    return data, ptr - base


class _Mapping:
    __slots__ = ("ptr", "device", "refs")

    def __init__(self, ptr: int, device: int) -> None:
        self.ptr = ptr
        self.device = device
        self.refs = 1


_maps: dict[bytes, _Mapping] = {}


def open_ipc(handle: bytes, device: int) -> int:
    """Map a peer's allocation into this process (once; reference counted); its base address."""
    rt = _api()
    handle = bytes(handle)
    if len(handle) != IPC_HANDLE_SIZE:
        raise InvalidArgument(f"a CUDA IPC handle has {IPC_HANDLE_SIZE} bytes, not {len(handle)}")
    with _lock:
        m = _maps.get(handle)
        if m is not None:
            m.refs += 1
            return m.ptr
        _set_device(device)
        h = rt.cudaIpcMemHandle_t()
        ctypes.memmove(h.getPtr(), handle, IPC_HANDLE_SIZE)
        ptr = int(
            _check(
                rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess),
                "cudaIpcOpenMemHandle",
            )
        )
        _maps[handle] = _Mapping(ptr, device)
        return ptr


def close_ipc(handle: bytes) -> None:
    """Drop one reference to a mapping made by :func:`open_ipc`; unmap at zero."""
    with _lock:
        m = _maps.get(bytes(handle))
        if m is None:
            return
        m.refs -= 1
        if m.refs > 0:
            return
        del _maps[bytes(handle)]
        try:
            _set_device(m.device)
            _check(_rt.cudaIpcCloseMemHandle(m.ptr), "cudaIpcCloseMemHandle")
        except TransferError as exc:
            log.warning("closing a CUDA IPC mapping: %s", exc)


def open_mappings() -> int:
    """Number of peer allocations currently mapped (tests, metrics)."""
    return len(_maps)


def _close_all() -> None:
    for handle in list(_maps):
        _maps[handle].refs = 1
        close_ipc(handle)


# --------------------------------------------------------------------------------------------
# Copies
# --------------------------------------------------------------------------------------------


class _Streams(threading.local):
    def __init__(self) -> None:
        self.by_device: dict[int, Any] = {}


_streams = _Streams()


def _stream(device: int) -> Any:
    s = _streams.by_device.get(device)
    if s is None:
        s = _check(
            _rt.cudaStreamCreateWithFlags(_rt.cudaStreamNonBlocking),
            f"cudaStreamCreateWithFlags on device {device}",
        )
        _streams.by_device[device] = s
    return s


def copy_runs(
    dst: int,
    dst_offsets: np.ndarray,
    src: int,
    src_offsets: np.ndarray,
    lengths: np.ndarray,
    device: int,
    check: Callable[[], None] | None = None,
) -> None:
    """Copy ``lengths[i]`` bytes from ``src + src_offsets[i]`` to ``dst + dst_offsets[i]``.

    Either side may be host or device memory (``cudaMemcpyDefault``, unified addressing).
    The copies are queued on this thread's stream of ``device`` and waited for once; between
    every 256 queued copies ``check()`` may raise to stop (the queued ones still finish
    before this returns, so no copy outlives the call).
    """
    rt = _api()
    _set_device(device)
    stream = _stream(device)
    kind = rt.cudaMemcpyKind.cudaMemcpyDefault
    memcpy = rt.cudaMemcpyAsync
    failure: BaseException | None = None
    try:
        for i, (d, s, n) in enumerate(
            zip(dst_offsets.tolist(), src_offsets.tolist(), lengths.tolist())
        ):
            if check is not None and i and not i % 256:
                check()
            res = memcpy(dst + d, src + s, n, kind, stream)
            err = res[0] if isinstance(res, tuple) else res
            if int(err) != 0:
                raise CudaError(f"cudaMemcpyAsync of {n} bytes: {_err_text(rt, err)}")
    except BaseException as exc:
        failure = exc
    sync = rt.cudaStreamSynchronize(stream)
    err = sync[0] if isinstance(sync, tuple) else sync
    if failure is not None:
        raise failure
    if int(err) != 0:
        raise CudaError(f"cudaStreamSynchronize: {_err_text(rt, err)}")


def copy(dst: int, src: int, nbytes: int, device: int = 0) -> None:
    """One synchronous copy of ``nbytes`` (host or device on either side)."""
    one = np.zeros(1, np.uint64)
    copy_runs(dst, one, src, one, np.array([nbytes], np.uint64), device)


def malloc(nbytes: int, device: int = 0) -> int:
    """``cudaMalloc`` on ``device`` (tests and scripts/gpu_check.sh; the engine never allocates)."""
    rt = _api()
    _set_device(device)
    return int(_check(rt.cudaMalloc(nbytes), f"cudaMalloc({nbytes})"))


def free(ptr: int, device: int = 0) -> None:
    rt = _api()
    _set_device(device)
    _check(rt.cudaFree(ptr), "cudaFree")
