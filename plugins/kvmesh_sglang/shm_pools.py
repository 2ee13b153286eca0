"""CPU KV pools (and PD aux buffers) in kvmesh shared memory, so same-host PD copies are memcpy.

SGLang allocates its pools with ``torch.zeros``/``torch.empty`` in private memory; a same-host
decode peer's pool is then reachable only through NIXL/UCX cma (``process_vm_writev``, one
stream, docs/sglang.md "Same-host ceiling"). With ``KVMESH_SGLANG_SHM_POOLS=1`` the plugin wraps
the methods that create the pool buffers (:data:`TARGETS`, ``HookRegistry`` AROUND hooks) and,
only while they run and only for CPU pools, serves each CPU ``torch.zeros/empty/ones/full`` from
its own :class:`kvmesh.transfer.SharedBuffer`. Shapes, dtypes, strides, aliasing (K and V halves
of one fused allocation) and every pointer captured inside the method (``k_data_ptrs``,
``data_ptrs``) are those of the tensors the pool keeps: nothing is copied or swapped afterwards.
When the drop-in later ``batch_register``s those pointers the engine finds them inside a
SharedBuffer and registers them as SHM, and a same-host peer writes them with the ``shm``
transport (a mapped file, memcpy), under the engine's fences like any SHM segment.

CUDA (and NPU) pools are never touched: the hook passes through unless the pool's device is
``cpu``, and inside it only CPU allocations of strided, unpinned, non-grad tensors are served.

Lifetime: each tensor's storage keeps a small ctypes holder alive, which keeps the SharedBuffer;
when the last tensor or view on it is gone the buffer is closed (unmapped, file unlinked). As
with private memory, the pool must be deregistered from the engine before it is freed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from kvmesh.transfer import SharedBuffer

log = logging.getLogger("kvmesh.sglang.shm_pools")

ENV_SHM_POOLS = "KVMESH_SGLANG_SHM_POOLS"
_ON = {"1", "true", "yes", "on"}
_MP = "sglang.srt.mem_cache.memory_pool."
# The methods of SGLang 0.5.23 that allocate KV pool buffers (a subclass that overrides
# _create_buffers without calling the base one needs its own entry), and the PD aux buffers.
POOL_TARGETS = (
    _MP + "MHATokenToKVPool._create_buffers",
    _MP + "MHATokenToKVPoolFP4._create_buffers",
    _MP + "MHATokenToKVPoolMXFP8._create_buffers",
    _MP + "PageMajorMHATokenToKVPool._create_buffers",
    _MP + "MLATokenToKVPool._create_buffers",
    _MP + "MLATokenToKVPoolFP4._create_buffers",
)
AUX_TARGETS = ("sglang.srt.disaggregation.utils.MetadataBuffers.__init__",)
TARGETS = POOL_TARGETS + AUX_TARGETS

_stats_lock = threading.Lock()
stats = {"buffers": 0, "bytes": 0, "fallbacks": 0}  # this process, for logs and tests


def shm_pools_enabled() -> bool:
    return os.environ.get(ENV_SHM_POOLS, "0").strip().lower() in _ON


def shared_tensor(shape: tuple[int, ...], dtype: Any) -> Any:
    """A zeroed CPU tensor of ``shape`` and ``dtype`` in its own SharedBuffer."""
    import torch

    nbytes = max(1, torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size())
    buf = SharedBuffer.create(nbytes)  # a new /dev/shm file: zero-filled
    holder = (ctypes.c_ubyte * buf.size).from_address(buf.addr)
    holder._kvmesh_shm = buf  # type: ignore[attr-defined]  # the storage keeps the buffer
    weakref.finalize(holder, buf.close)
    raw = torch.frombuffer(holder, dtype=torch.uint8)[:nbytes]
    with _stats_lock:
        stats["buffers"] += 1
        stats["bytes"] += nbytes
    return raw.view(dtype).view(shape)


def _factory_size(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple | None:
    if "size" in kwargs:
        size, rest = kwargs["size"], args
    elif args and isinstance(args[0], (tuple, list)):
        size, rest = args[0], args[1:]
    else:
        n = len(args) - (1 if name == "full" else 0)
        size, rest = args[:n], args[n:]
    if name == "full" and len(rest) != 1 and "fill_value" not in kwargs:
        return None
    if name != "full" and rest:
        return None
    try:
        return tuple(int(s) for s in size)
    except (TypeError, ValueError):
        return None


_PASS_KW = {"dtype", "device", "size", "fill_value", "layout", "requires_grad", "pin_memory"}
_FACTORIES = ("zeros", "empty", "ones", "full")


def _wanted(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple | None:
    """The size to serve from shared memory, or None to leave the call to torch."""
    import torch

    if set(kwargs) - _PASS_KW:  # out=, memory_format=, names=, generator=: torch's business
        return None
    if kwargs.get("requires_grad") or kwargs.get("pin_memory"):
        return None
    if kwargs.get("layout") not in (None, torch.strided):
        return None
    device = kwargs.get("device")
    device = torch.get_default_device() if device is None else torch.device(device)
    if device.type != "cpu":
        return None
    size = _factory_size(name, args, kwargs)
    if size is None or any(s < 0 for s in size) or torch.Size(size).numel() == 0:
        return None
    return size


@functools.cache
def _mode_class() -> type:
    import torch
    from torch.overrides import TorchFunctionMode

    factories = {getattr(torch, n): n for n in _FACTORIES}

    class SharedAllocations(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            name = factories.get(func)
            size = None if name is None else _wanted(name, args, kwargs)
            if size is None:
                return func(*args, **kwargs)
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            try:
                t = shared_tensor(size, dtype)
            except OSError as e:
                # A short /dev/shm (containers default to 64 MiB): the engine refuses a buffer
                # it has no room for (it would SIGBUS on first touch) with ENOSPC.
                if e.errno != errno.ENOSPC:
                    raise
                with _stats_lock:
                    stats["fallbacks"] += 1
                log.warning(
                    "kvmesh shm pools: %s; this buffer stays in private memory (same-host PD "
                    "copies of it go through cma)",
                    e.strerror,
                )
                return func(*args, **kwargs)
            if name == "ones":
                t.fill_(1)
            elif name == "full":
                t.fill_(kwargs["fill_value"] if "fill_value" in kwargs else args[-1])
            return t

    return SharedAllocations


@contextlib.contextmanager
def shared_allocations() -> Iterator[None]:
    """CPU tensor factories inside this block allocate kvmesh shared memory (this thread)."""
    with _mode_class()():
        yield


def _is_cpu_pool(obj: Any) -> bool:
    device = getattr(obj, "device", None)
    return device is not None and str(device).split(":")[0] == "cpu"


def around_pool(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of a pool's buffer creation: shared memory for CPU pools, else untouched."""
    if not args or not _is_cpu_pool(args[0]):
        return original(*args, **kwargs)
    with shared_allocations():
        return original(*args, **kwargs)


def around_aux(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``MetadataBuffers.__init__`` (its rows are CPU unless NPU / custom pool)."""
    with shared_allocations():
        return original(*args, **kwargs)


def install(registry: Any, hook_type: Any) -> None:
    """Register the AROUND hooks with SGLang's ``HookRegistry``."""
    for target in POOL_TARGETS:
        registry.register(target, around_pool, hook_type)
    for target in AUX_TARGETS:
        registry.register(target, around_aux, hook_type)
