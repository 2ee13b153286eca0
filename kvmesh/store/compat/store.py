"""``MooncakeDistributedStore`` on :class:`~kvmesh.store.client.StoreClient`: every method of
Mooncake 0.3.13's (and 0.3.14's ``probe_key`` / ``batch_probe_key``), with Mooncake's
argument names, defaults and results.

Results are plain ``int``: 0 for success, bytes read for reads, 1/0 for existence, negative
Mooncake codes (-704 not found, -706 has lease, -600 invalid parameters, -1012 not
supported...). A condition Mooncake reports as a code is never an exception here; a call of
the wrong shape (a ``str`` where Mooncake takes a key list, an unknown keyword) raises
``TypeError``, as pybind11 does in Mooncake. The differences are the compatibility table of
docs/store.md.

Each store is one Mooncake client: its own master connection and, with a
``global_segment_size``, its own storage node and segment named by :meth:`get_hostname`
(``host:port``), all on the process's one transfer engine. Any number may live in one
process; ``close`` unmounts (the store's objects whose only copy was there go, as in
Mooncake) and ``setup`` may follow again.
"""

from __future__ import annotations

import ctypes
import logging
import random
import re
import threading
from collections.abc import Callable
from typing import Any

from ...transfer import TransferError
from .. import errors as E
from ..client import StoreClient
from ..node import StorageNode
from ..rpc import MasterClient
from ..types import ReplicateConfig as _Config
from . import config as C
from ._common import (
    NO_SPACE,
    T_MAX_SESSION,
    _config,
    _each,
    _each_empty,
    _each_none,
    _empty,
    _empty_dict,
    _empty_list,
    _guard,
    _int,
    _ints,
    _key,
    _keys,
    _nested,
    _none,
    _NotSetUp,
    _one,
    _put_code,
    _res,
)
from .constants import (
    BUFFER_OVERFLOW,
    INVALID_PARAMS,
    NOT_SUPPORTED,
    OBJECT_EXISTS,
    OBJECT_NOT_FOUND,
    SoftPinAction,
    code,
)
from .tensor_methods import TensorMethods
from .types import (
    BufferHandle,
    Descriptor,
    MemoryDescriptor,
    ReplicaDescriptor,
    ReplicateConfig,
)

__all__ = ["MooncakeDistributedStore", "literal_prefix"]

log = logging.getLogger("kvmesh.store.compat")

SEGMENT_EXISTS = int(E.Code.SEGMENT_ALREADY_EXISTS)
_PORTS = (12300, 14300)  # Mooncake's range for a hostname given without a port
_DEFAULT = ReplicateConfig()

# get_hostname() -> the segment actually mounted (a name taken earlier in the master's
# quarantine gets a suffix), so a preferred_segment naming a store of this process finds it.
_SEGMENTS: dict[str, str] = {}
_SEG_LOCK = threading.Lock()

_REGEX_META = frozenset(".^$*+?{}[]\\|()")


def literal_prefix(pattern: str) -> str | None:
    """The literal prefix a regex ``^<literal>[.*][$]`` selects, else None (any other
    pattern: an unanchored one, classes, alternations, quantifiers on the literal)."""
    if type(pattern) is not str or not pattern.startswith("^"):
        return None
    body = pattern[1:]
    for tail in (".*$", ".*", "$"):
        if body.endswith(tail) and not body.endswith("\\" + tail):
            if tail == "$":
                return None  # "^abc$" is one key, not a prefix: use remove()
            body = body[: -len(tail)]
            break
    out = []
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "\\":
            if i + 1 >= len(body) or body[i + 1].isalnum() or body[i + 1] == "_":
                return None  # \d, \w, a trailing backslash...: not a literal
            out.append(body[i + 1])
            i += 2
            continue
        if ch in _REGEX_META:
            return None
        out.append(ch)
        i += 1
    return "".join(out) or None


class MooncakeDistributedStore(TensorMethods):
    """The Mooncake client API. Create, ``setup(...)``, use, ``close()``."""

    def __init__(self) -> None:
        self._c: StoreClient | None = None
        self._nodes: dict[str, StorageNode] = {}  # segment name -> this store's node
        self._node_rpc: MasterClient | None = None  # mounts as storage node <engine id>
        self._hostname = ""
        self._segment = ""
        self._local_buffer = 0
        self._regs: dict[int, int] = {}  # registered buffers: ptr -> size
        self._put_sessions: dict[str, tuple[bytearray, Any]] = {}
        self._get_sessions: dict[str, bytes] = {}
        self._lock = threading.Lock()

    # ================================================================== setup and lifecycle

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, engine=None, ...)`` or
        ``setup(config: dict)``. ``master_server_addr``: kvmesh master addresses
        (comma-separated), or ``""`` / ``"embedded"`` for this process's embedded store.
        ``global_segment_size``: bytes this store contributes (its own segment); 0: none.
        ``local_hostname`` names the segment (``get_hostname``); ``metadata_server``,
        ``protocol``, ``rdma_devices`` are accepted and unused (kvmesh's transfer engine
        finds peers and transports itself); ``engine`` (Mooncake's own transfer engine)
        answers -1012."""
        if len(args) == 1 and not kwargs and isinstance(args[0], dict):
            s = C.from_dict(args[0])
        elif kwargs.keys() == {"config"} and not args and isinstance(kwargs["config"], dict):
            s = C.from_dict(kwargs["config"])
        else:
            s = C.from_positional(args, kwargs)  # TypeError for a call that does not fit
        if s.error:
            return s.error
        if s.engine is not None:
            return NOT_SUPPORTED
        with self._lock:
            if self._c is not None:
                return INVALID_PARAMS  # set up twice: close() first
            return self._setup(s)

    def _setup(self, s: C.Setup) -> int:
        master = s.master_server_addr.strip()
        try:
            c = StoreClient(None if master in ("", "embedded") else master, segment_size=0)
        except E.StoreError as e:
            return code(e.code)
        except (OSError, ValueError, TransferError) as e:
            log.warning("kvmesh compat setup failed: %s", e)
            return INVALID_PARAMS
        host, _, port = s.local_hostname.rpartition(":")
        if not host or not port.isdigit():
            host, port = s.local_hostname or "localhost", ""
        self._c = c
        self._local_buffer = s.local_buffer_size
        self._hostname = f"{host}:{port or random.randint(*_PORTS)}"
        if s.global_segment_size <= 0:
            return 0
        rc = self._mount_own(host, port, s.global_segment_size)
        if rc != 0:
            self._c = None
            if self._node_rpc is not None:
                self._node_rpc.close()
                self._node_rpc = None
            c.close()
        return rc

    def _mount_own(self, host: str, port: str, size: int) -> int:
        """Mount this store's segment as ``host:port``: a random port (Mooncake's range)
        until a free name is found when none was given; else the given name, suffixed when
        the master still quarantines it (a segment of that name was unmounted lately)."""
        rc = INVALID_PARAMS
        for attempt in range(16):
            if port:
                name = self._hostname if attempt == 0 else f"{self._hostname}#{attempt}"
            else:
                self._hostname = name = f"{host}:{random.randint(*_PORTS)}"
            rc = self._mount(name, size)
            if rc != SEGMENT_EXISTS:
                break
        if rc == 0:
            self._segment = name
            with _SEG_LOCK:
                _SEGMENTS[self._hostname] = name
        return rc

    def _mount(self, name: str, size: int) -> int:
        c = self._live()
        if self._node_rpc is None:
            # The store's own connection speaks as a client; mounting needs storage node
            # <engine id> (whose credential covers the per-segment sub-nodes, net/identity.py).
            self._node_rpc = MasterClient(c.rpc.addrs, c.rpc.sec, node_id=c.engine.node_id)
        node = StorageNode(
            self._node_rpc, size, engine=c.engine, segment=name, node_id=self._node_id(name)
        )
        try:
            node.start()
        except E.StoreError as e:
            return code(e.code)
        except TransferError as e:  # the name is published by this engine already
            log.info("kvmesh compat: segment %s: %s", name, e)
            return SEGMENT_EXISTS
        except (OSError, ValueError, MemoryError) as e:
            log.warning("kvmesh compat: segment of %d bytes: %s", size, e)
            return NO_SPACE
        self._nodes[name] = node
        return 0

    def _node_id(self, segment: str) -> str:
        return f"{self._live().engine.node_id}/{segment}"

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Mooncake's dummy client (a process that talks to a local real client over IPC):
        here a store that contributes ``mem_pool_size`` bytes on the master at
        ``server_address`` (kvmesh has no separate real-client process)."""
        _int(mem_pool_size, "mem_pool_size")
        _int(local_buffer_size, "local_buffer_size")
        if not isinstance(server_address, str):
            raise TypeError("server_address must be str")
        return self.setup(
            "localhost", "", mem_pool_size, local_buffer_size, "tcp", "", server_address
        )

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = 16 << 20) -> int:
        """Mooncake's ``initAll``: set up against this process's embedded store with a
        segment of ``mount_segment_size`` bytes."""
        return self.setup("localhost", "", mount_segment_size, 16 << 20, protocol, device_name, "")

    def get_hostname(self) -> str:
        """``host:port`` naming this store's segment (stable until ``close``); usable as
        ``ReplicateConfig.preferred_segment``."""
        return self._hostname

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 master unreachable (Mooncake's values)."""
        c = self._c
        if c is None:
            return 1
        try:
            c.status()
        except E.StoreError:
            return 2
        return 0

    def close(self) -> int:
        """Unmount this store's segments (objects whose only copy was there are gone),
        release its buffers and connection. 0; closing twice is fine."""
        with self._lock:
            c, self._c = self._c, None
            nodes, self._nodes = list(self._nodes.values()), {}
            node_rpc, self._node_rpc = self._node_rpc, None
            self._regs.clear()
            self._put_sessions.clear()
            self._get_sessions.clear()
            with _SEG_LOCK:
                if _SEGMENTS.get(self._hostname) == self._segment:
                    _SEGMENTS.pop(self._hostname, None)
        for n in nodes:
            try:
                n.close()
            except Exception:  # noqa: BLE001 - the master expires it later
                log.warning("kvmesh compat: unmounting %s failed", n.segment, exc_info=True)
        if node_rpc is not None:
            node_rpc.close()
        if c is not None:
            c.close()
        return 0

    def __del__(self) -> None:
        # Mooncake's store is closed by its destructor and callers rely on it (SGLang's
        # MooncakeStore.close() is a no-op): a dropped store must not leave its buffers
        # registered in the process-wide engine after their memory was freed.
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing left to report to
            pass

    @property
    def client(self) -> StoreClient:
        """The underlying :class:`StoreClient` (kvmesh extension)."""
        return self._live()

    def _live(self) -> StoreClient:
        c = self._c
        if c is None:
            raise _NotSetUp
        return c

    # ------------------------------------------------------------------ segments

    @_guard(_empty_dict)
    def allocate_and_mount_segment(
        self, size: int, protocol: str = "tcp", location: str = ""
    ) -> dict:
        """Another segment of ``size`` bytes for this store: ``{"segment_id": name,
        "base": 0, "size": size}`` with ``"error_code"`` 0, or only ``"error_code"``."""
        size = _int(size, "size")
        if size <= 0:
            return {"error_code": INVALID_PARAMS}
        name = f"{self._hostname}+{len(self._nodes)}.{random.getrandbits(24):06x}"
        rc = self._mount(name, size)
        if rc != 0:
            return {"error_code": rc}
        return {"error_code": 0, "segment_id": name, "base": 0, "size": size}

    def mount_segment(
        self, path: str, size: int, offset: int = 0, protocol: str = "tcp", location: str = ""
    ) -> dict:
        """Mounting memory that Mooncake's caller mapped itself (a file, CXL, a device):
        kvmesh segments are memory its own engine allocates. -1012."""
        return {"error_code": NOT_SUPPORTED}

    @_guard(_one)
    def unmount_segment(self, segment_ids: list[str], grace_period_seconds: int = 0) -> int:
        """Unmount this store's segments by name (after ``grace_period_seconds`` of draining:
        no new copies, old ones readable); 0, or -101 for a name this store did not mount."""
        ids = _keys(segment_ids)
        grace = _int(grace_period_seconds, "grace_period_seconds")
        with self._lock:
            if any(i not in self._nodes for i in ids):
                return int(E.Code.SEGMENT_NOT_FOUND)
            nodes = [self._nodes.pop(i) for i in ids]
        for n in nodes:
            n.close(grace_s=float(grace))
        return 0

    def unmount_and_free_segment(
        self, segment_ids: list[str], grace_period_seconds: int = 0
    ) -> int:
        """:meth:`unmount_segment`: kvmesh frees a segment's memory when it unmounts it."""
        return self.unmount_segment(segment_ids, grace_period_seconds)

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        """No local-disk segment exists on kvmesh (its disk tier belongs to the storage
        nodes). -1012."""
        return NOT_SUPPORTED

    def alloc_from_mem_pool(self, size: int) -> int:
        """Mooncake's dummy-client shared pool (an address in memory shared with the real
        client): kvmesh has no such pool. 0 (Mooncake's "no address")."""
        return 0

    # ------------------------------------------------------------------ buffers

    @_guard(_one)
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        ptr, n = _int(buffer_ptr, "buffer_ptr"), _int(size, "size")
        if ptr <= 0 or n <= 0:
            return INVALID_PARAMS
        self._live().register_buffer(ptr, n)
        self._regs[ptr] = n
        return 0

    @_guard(_one)
    def unregister_buffer(self, buffer_ptr: int) -> int:
        ptr = _int(buffer_ptr, "buffer_ptr")
        self._live().unregister_buffer(ptr)
        self._regs.pop(ptr, None)
        return 0

    def _registered(self, ptr: int, n: int) -> bool:
        """Whether ``[ptr, ptr + n)`` lies in one buffer this store registered."""
        return any(p <= ptr and ptr + n <= p + z for p, z in self._regs.items())

    # ================================================================== put / upsert

    def _cfg(self, cfg: ReplicateConfig, nkeys: int) -> tuple[_Config | None, int]:
        """kvmesh's placement for Mooncake's config, or (None, the code refusing it)."""
        if cfg.soft_pin_ttl_ms is not None and cfg.soft_pin_action != SoftPinAction.ENABLE:
            return None, INVALID_PARAMS  # Mooncake's master: a TTL needs ENABLE
        if cfg.nof_replica_num or cfg.dfs_replica_num or cfg.preferred_nof_segments:
            return None, NOT_SUPPORTED
        if cfg.group_ids is not None and len(cfg.group_ids) != nkeys:
            return None, INVALID_PARAMS
        if cfg.replica_num < 1:
            return None, INVALID_PARAMS
        pref = cfg.preferred_segment or (
            cfg.preferred_segments[0] if cfg.preferred_segments else ""
        )
        if pref:
            with _SEG_LOCK:
                pref = _SEGMENTS.get(pref, pref)
        c = self._live()
        return (
            _Config(
                replica_num=cfg.replica_num,
                preferred_segment=pref or None,
                writer_host=c.engine.host_id,
                soft_pin=cfg.soft_pin_action == SoftPinAction.ENABLE,
                hard_pin=cfg.with_hard_pin,
            ),
            0,
        )

    def _staged(self, nbytes: int) -> int:
        """Mooncake's byte-path puts and gets go through its local buffer: none (size 0), or
        one too small for the object, fails with -10."""
        return 0 if nbytes <= self._local_buffer else BUFFER_OVERFLOW

    def _put_values(
        self, keys: list[str], values: list[Any], config: Any, upsert: bool
    ) -> list[int]:
        cfg, err = self._cfg(_config(config), len(keys))
        if err:
            return [err] * len(keys)
        views = []
        for v in values:
            try:
                views.append(memoryview(v).cast("B"))
            except TypeError:
                what = type(v).__name__
                raise TypeError(f"a value must support the buffer protocol, got {what}") from None
        out = [self._staged(len(v)) for v in views]
        todo = [i for i, r in enumerate(out) if r == 0]
        if not todo:
            return out
        op = self._live().upsert if upsert else self._live().put
        res = op([keys[i] for i in todo], [views[i] for i in todo], config=cfg)
        for i, r in zip(todo, res):
            out[i] = _res(r) if upsert else _put_code(r)
        return out

    @_guard(_one)
    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._put_values([_key(key)], [value], config, False)[0]

    @_guard(_one)
    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._put_values([_key(key)], [value], config, True)[0]

    @_guard(_one)
    def put_batch(
        self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None
    ) -> int:
        """0, or the first key's failure (Mooncake answers one code for the batch)."""
        ks = _keys(keys)
        if len(ks) != len(values):
            return INVALID_PARAMS
        return next((c for c in self._put_values(ks, list(values), config, False) if c), 0)

    @_guard(_one)
    def upsert_batch(
        self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None
    ) -> int:
        ks = _keys(keys)
        if len(ks) != len(values):
            return INVALID_PARAMS
        return next((c for c in self._put_values(ks, list(values), config, True) if c), 0)

    def _parts(self, key: str, parts: tuple, config: Any, upsert: bool) -> int:
        try:
            views = [memoryview(p).cast("B") for p in parts]
        except TypeError:
            raise TypeError("put_parts: every part must support the buffer protocol") from None
        if not views:
            return INVALID_PARAMS
        return self._put_values([_key(key)], [b"".join(views)], config, upsert)[0]

    @_guard(_one)
    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """The parts concatenated, as one object."""
        return self._parts(key, parts, config, False)

    @_guard(_one)
    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        return self._parts(key, parts, config, True)

    def _put_ptrs(
        self, keys: list[str], ptrs: list[int], sizes: list[int], config: Any, upsert: bool
    ) -> list[int]:
        if not (len(keys) == len(ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        if not keys:
            return []
        cfg, err = self._cfg(_config(config), len(keys))
        if err:
            return [err] * len(keys)
        c = self._live()
        op = c.upsert_from if upsert else c.put_from
        res = op(keys, ptrs, 0, sizes, config=cfg)
        return [_res(r) if upsert else _put_code(r) for r in res]

    @_guard(_one)
    def put_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        return self._put_ptrs([_key(key)], [_int(buffer_ptr)], [_int(size)], config, False)[0]

    @_guard(_one)
    def upsert_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        return self._put_ptrs([_key(key)], [_int(buffer_ptr)], [_int(size)], config, True)[0]

    @_guard(_each)
    def batch_put_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        return self._put_ptrs(
            _keys(keys), _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes"), config, False
        )

    @_guard(_each)
    def batch_upsert_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        return self._put_ptrs(
            _keys(keys), _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes"), config, True
        )

    def _put_multi(
        self,
        keys: list[str],
        ptrs: list[list[int]],
        sizes: list[list[int]],
        config: Any,
        upsert: bool,
    ) -> list[int]:
        if not (len(keys) == len(ptrs) == len(sizes)) or any(
            len(p) != len(z) for p, z in zip(ptrs, sizes)
        ):
            return [INVALID_PARAMS] * len(keys)
        if not keys:
            return []
        cfg, err = self._cfg(_config(config), len(keys))
        if err:
            return [err] * len(keys)
        res = self._live().put_from_multi(keys, ptrs, sizes, config=cfg, upsert=upsert)
        return [_res(r) if upsert else _put_code(r) for r in res]

    @_guard(_one)
    def put_from_with_metadata(
        self,
        key: str,
        buffer_ptr: int,
        metadata_buffer_ptr: int,
        size: int,
        metadata_size: int,
        config: ReplicateConfig | None = None,
    ) -> int:
        """One object: the ``metadata_size`` bytes at ``metadata_buffer_ptr``, then the
        ``size`` bytes at ``buffer_ptr`` (Mooncake's order)."""
        ptrs = [_int(metadata_buffer_ptr), _int(buffer_ptr)]
        sizes = [_int(metadata_size), _int(size)]
        keep = [i for i in range(2) if sizes[i] > 0]
        return self._put_multi(
            [_key(key)], [[ptrs[i] for i in keep]], [[sizes[i] for i in keep]], config, False
        )[0]

    @_guard(_each)
    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Object ``i``: the buffers ``all_buffer_ptrs[i]`` (``all_sizes[i]`` bytes each)
        concatenated, written zero-copy."""
        return self._put_multi(
            _keys(keys),
            _nested(all_buffer_ptrs, "all_buffer_ptrs", 2),
            _nested(all_sizes, "all_sizes", 2),
            config,
            False,
        )

    # ------------------------------------------------------------------ put sessions

    @_guard(_each)
    def batch_put_session_start(
        self, keys: list[str], sizes: list[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        """Reserve objects of ``sizes`` bytes, written by ranges with
        :meth:`batch_put_from_multi_buffer_ranges` and published by
        :meth:`batch_put_session_end` (unreadable before). kvmesh stages the ranges in this
        process and puts the objects at the end, in one batch."""
        ks, zs = _keys(keys), _ints(sizes, "sizes")
        if len(ks) != len(zs):
            return [INVALID_PARAMS] * len(ks)
        cfg, err = self._cfg(_config(config), len(ks))
        if err:
            return [err] * len(ks)
        exists = self._live().exists(ks)
        out = []
        with self._lock:
            for k, z, e in zip(ks, zs, exists):
                if z <= 0 or z > T_MAX_SESSION or k in self._put_sessions:
                    out.append(INVALID_PARAMS)
                elif e is True:
                    out.append(OBJECT_EXISTS)
                elif isinstance(e, E.StoreError):
                    out.append(code(e.code))
                else:
                    self._put_sessions[k] = (bytearray(z), cfg)
                    out.append(0)
        return out

    @_guard(_each)
    def batch_put_from_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        all_dst_offsets: list[list[int]],
    ) -> list[int]:
        """Into each started object ``keys[i]``: ``all_sizes[i][k]`` bytes from
        ``all_buffer_ptrs[i][k]`` (registered memory) at offset ``all_dst_offsets[i][k]``."""
        ks = _keys(keys)
        ptrs = _nested(all_buffer_ptrs, "all_buffer_ptrs", 2)
        sizes = _nested(all_sizes, "all_sizes", 2)
        offs = _nested(all_dst_offsets, "all_dst_offsets", 2)
        if not (len(ks) == len(ptrs) == len(sizes) == len(offs)):
            return [INVALID_PARAMS] * len(ks)
        out = []
        for k, p, z, o in zip(ks, ptrs, sizes, offs):
            sess = self._put_sessions.get(k)
            if sess is None:
                out.append(OBJECT_NOT_FOUND)
                continue
            buf = sess[0]
            if not (len(p) == len(z) == len(o)) or any(
                n < 0 or d < 0 or d + n > len(buf) or not self._registered(a, n)
                for a, n, d in zip(p, z, o)
            ):
                out.append(INVALID_PARAMS)
                continue
            for a, n, d in zip(p, z, o):
                buf[d : d + n] = ctypes.string_at(a, n)
            out.append(0)
        return out

    @_guard(_each)
    def batch_put_session_end(self, keys: list[str]) -> list[int]:
        ks = _keys(keys)
        with self._lock:
            got = [self._put_sessions.pop(k, None) for k in ks]
        out = [0 if s is not None else OBJECT_NOT_FOUND for s in got]
        todo = [i for i, s in enumerate(got) if s is not None]
        # one batch per distinct config (usually one)
        by_cfg: dict[int, list[int]] = {}
        for i in todo:
            by_cfg.setdefault(id(got[i][1]), []).append(i)  # type: ignore[index]
        for idx in by_cfg.values():
            cfg = got[idx[0]][1]  # type: ignore[index]
            res = self._live().put([ks[i] for i in idx], [got[i][0] for i in idx], config=cfg)  # type: ignore[index]
            for i, r in zip(idx, res):
                out[i] = _put_code(r)
        return out

    @_guard(_each)
    def batch_put_session_revoke(self, keys: list[str]) -> list[int]:
        ks = _keys(keys)
        with self._lock:
            return [
                0 if self._put_sessions.pop(k, None) is not None else OBJECT_NOT_FOUND for k in ks
            ]

    # ================================================================== get

    def _get_values(self, keys: list[str], into: Any = None) -> list[Any]:
        """Per key the object's bytes (``into(view)`` of them with ``into``, see
        :meth:`StoreClient.get`), or a negative code."""
        if not keys:
            return []
        res = self._live().get(keys, into=into)
        out: list[Any] = []
        for r in res:
            if isinstance(r, (bytes, bytearray)):
                out.append(r if self._staged(len(r)) == 0 else BUFFER_OVERFLOW)
            else:
                out.append(_res(r) or INVALID_PARAMS)
        return out

    @_guard(_empty)
    def get(self, key: str) -> bytes:
        """The object's bytes; ``b""`` when it is missing or the read fails (Mooncake)."""
        r = self._get_values([_key(key)])[0]
        return r if isinstance(r, bytes) else b""

    @_guard(_each_empty)
    def get_batch(self, keys: list[str]) -> list[bytes]:
        return [r if isinstance(r, bytes) else b"" for r in self._get_values(_keys(keys))]

    @_guard(_none)
    def get_buffer(self, key: str) -> BufferHandle | None:
        """A :class:`BufferHandle` holding the object's bytes; None when it is missing. The
        bytes are copied once, out of the staging buffer into the handle."""
        r = self._get_values([_key(key)], BufferHandle)[0]
        return r if isinstance(r, BufferHandle) else None

    @_guard(_each_none)
    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        return [
            r if isinstance(r, BufferHandle) else None
            for r in self._get_values(_keys(keys), BufferHandle)
        ]

    def _get_ptrs(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        if not (len(keys) == len(ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        if not keys:
            return []
        res = self._live().get_into(keys, ptrs, 0, sizes)
        return [
            r if isinstance(r, int) and not isinstance(r, E.StoreError) else _res(r) for r in res
        ]

    @_guard(_one)
    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read into the registered buffer, or a negative code (-10: too small)."""
        return self._get_ptrs([_key(key)], [_int(buffer_ptr)], [_int(size)])[0]

    @_guard(_each)
    def batch_get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        return self._get_ptrs(_keys(keys), _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes"))

    @_guard(_each)
    def batch_get_into_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Object ``i`` filled into the buffers ``all_buffer_ptrs[i]`` in order; bytes read."""
        ks = _keys(keys)
        ptrs = _nested(all_buffer_ptrs, "all_buffer_ptrs", 2)
        sizes = _nested(all_sizes, "all_sizes", 2)
        if not (len(ks) == len(ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(ks)
        if not ks:
            return []
        res = self._live().get_into_multi(ks, ptrs, sizes)
        return [
            r if isinstance(r, int) and not isinstance(r, E.StoreError) else _res(r) for r in res
        ]

    def _read_ranges(
        self,
        data: bytes | int,
        ptrs: list[int],
        dst: list[int],
        src: list[int],
        sizes: list[int],
        cap: Callable[[int, int], bool],
    ) -> list[int]:
        """Copy ``sizes[r]`` bytes of one object's ``data`` from ``src[r]`` to ``ptrs[r] +
        dst[r]``, per range its byte count or a negative code."""
        if not (len(dst) == len(src) == len(sizes) == len(ptrs)):
            return [INVALID_PARAMS]
        if isinstance(data, int):
            return [data] * max(1, len(sizes))
        out = []
        for p, d, s, n in zip(ptrs, dst, src, sizes):
            if n < 0 or s < 0 or d < 0 or s + n > len(data):
                out.append(INVALID_PARAMS)
            elif not cap(p + d, n):
                out.append(BUFFER_OVERFLOW)
            else:
                ctypes.memmove(p + d, data[s : s + n], n)
                out.append(n)
        return out

    @_guard(_empty_list)
    def get_into_ranges(
        self,
        buffer_ptrs: list[int],
        all_keys: list[list[str]],
        all_dst_offsets: list[list[list[int]]],
        all_src_offsets: list[list[list[int]]],
        all_sizes: list[list[list[int]]],
    ) -> list[list[list[int]]]:
        """Per buffer ``b``, per key ``k`` of ``all_keys[b]``, per range: copy
        ``all_sizes[b][k][r]`` bytes of the object from ``all_src_offsets[b][k][r]`` into
        registered buffer ``b`` at ``all_dst_offsets[b][k][r]``; the same nesting of byte
        counts or negative codes comes back (a key whose lists differ in length: one code)."""
        bufs = _ints(buffer_ptrs, "buffer_ptrs")
        keys = (
            [_keys(ks) for ks in all_keys]
            if isinstance(all_keys, (list, tuple))
            else _keys(all_keys)
        )
        dst = _nested(all_dst_offsets, "all_dst_offsets", 3)
        src = _nested(all_src_offsets, "all_src_offsets", 3)
        sizes = _nested(all_sizes, "all_sizes", 3)
        if not (len(bufs) == len(keys) == len(dst) == len(src) == len(sizes)):
            return [[[INVALID_PARAMS]] * len(k) for k in keys]
        wanted = sorted({k for ks in keys for k in ks})
        data = dict(zip(wanted, self._session_or_get(wanted)))
        out = []
        for b, ks, d, s, z in zip(bufs, keys, dst, src, sizes):
            if not (len(ks) == len(d) == len(s) == len(z)):
                out.append([[INVALID_PARAMS]] * len(ks))
                continue
            base = self._region_end(b)

            def fits(a: int, n: int, b: int = b, end: int | None = base) -> bool:
                return end is not None and b <= a and a + n <= end

            out.append(
                [
                    self._read_ranges(data[k], [b] * len(zz), dd, ss, zz, fits)
                    if (dd or ss or zz)
                    else []
                    for k, dd, ss, zz in zip(ks, d, s, z)
                ]
            )
        return out

    def _region_end(self, ptr: int) -> int | None:
        z = self._regs.get(ptr)
        return None if z is None else ptr + z

    def _session_or_get(self, keys: list[str]) -> list[bytes | int]:
        """Objects' bytes, from a get session where one holds them."""
        have = {k: self._get_sessions[k] for k in keys if k in self._get_sessions}
        rest = [k for k in keys if k not in have]
        got = dict(zip(rest, self._get_values_unstaged(rest)))
        return [have[k] if k in have else got[k] for k in keys]

    def _get_values_unstaged(self, keys: list[str]) -> list[bytes | int]:
        if not keys:
            return []
        return [
            r if isinstance(r, bytes) else (_res(r) or INVALID_PARAMS)
            for r in self._live().get(keys)
        ]

    # ------------------------------------------------------------------ get sessions

    @_guard(_each)
    def batch_get_session_start(self, keys: list[str]) -> list[int]:
        """Look the objects up once (kvmesh: read them once into this process) for ranged
        reads with :meth:`batch_get_into_multi_buffer_ranges`; per key 0 or a code."""
        ks = _keys(keys)
        vals = self._get_values_unstaged(ks)
        out = []
        with self._lock:
            for k, v in zip(ks, vals):
                if isinstance(v, bytes):
                    self._get_sessions[k] = v
                    out.append(0)
                else:
                    out.append(v)
        return out

    @_guard(_each)
    def batch_get_into_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        all_src_offsets: list[list[int]],
    ) -> list[int]:
        """Per key: ``all_sizes[i][k]`` bytes of the object from ``all_src_offsets[i][k]``
        into registered buffer ``all_buffer_ptrs[i][k]``; bytes read in all, or a code."""
        ks = _keys(keys)
        ptrs = _nested(all_buffer_ptrs, "all_buffer_ptrs", 2)
        sizes = _nested(all_sizes, "all_sizes", 2)
        src = _nested(all_src_offsets, "all_src_offsets", 2)
        if not (len(ks) == len(ptrs) == len(sizes) == len(src)):
            return [INVALID_PARAMS] * len(ks)
        data = self._session_or_get(ks)
        out = []
        for d, p, z, s in zip(data, ptrs, sizes, src):
            r = self._read_ranges(d, p, [0] * len(p), s, z, self._registered)
            bad = next((c for c in r if c < 0), 0)
            out.append(bad or sum(r))
        return out

    @_guard(_one)
    def batch_get_session_end(self, keys: list[str]) -> int:
        ks = _keys(keys)
        with self._lock:
            for k in ks:
                self._get_sessions.pop(k, None)
        return 0

    # ================================================================== query and remove

    @_guard(_one)
    def is_exist(self, key: str) -> int:
        """1 exists (COMPLETE), 0 not (exactly 0: LMCache counts any truthy answer as a hit),
        a negative code when the master cannot tell."""
        return self._exist([_key(key)])[0]

    def _exist(self, keys: list[str]) -> list[int]:
        if not keys:
            return []
        res = self._live().exists(keys)
        out = []
        for r in res:
            if isinstance(r, E.StoreError):
                out.append(0 if isinstance(r, E.InvalidKey) else code(r.code))
            else:
                out.append(1 if r else 0)
        return out

    @_guard(_each)
    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return self._exist(_keys(keys))

    @_guard(_one)
    def probe_key(self, key: str) -> int:
        """0.3.14's lease-free existence check: kvmesh's exists never grants a lease, so this
        is :meth:`is_exist`."""
        return self._exist([_key(key)])[0]

    @_guard(_each)
    def batch_probe_key(
        self, keys: list[str], policy: str = "none", candidate_size: int = 1
    ) -> list[int]:
        """0.3.14's batch probe (``policy`` / ``candidate_size`` choose replicas to warm in
        Mooncake; kvmesh has nothing to warm and ignores them)."""
        if not isinstance(policy, str):
            raise TypeError("policy must be str")
        _int(candidate_size, "candidate_size")
        return self._exist(_keys(keys))

    @_guard(_one)
    def get_size(self, key: str) -> int:
        r = self._live().get_size([_key(key)])[0]
        return _res(r) if isinstance(r, E.StoreError) else int(r)

    def _descs(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        res = self._live().replicas(keys) if keys else []
        out: dict[str, list[ReplicaDescriptor]] = {}
        for k, reps in zip(keys, res):
            if isinstance(reps, E.StoreError):
                out[k] = []
                continue
            descs = []
            for rep in reps:
                first = rep.slices[0]
                size = sum(s.length for s in rep.slices)
                descs.append(
                    ReplicaDescriptor(
                        MemoryDescriptor(Descriptor(size, first.offset, first.endpoint)),
                        first.segment,
                    )
                )
            out[k] = descs
        return out

    @_guard(_empty_list)
    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The object's COMPLETE copies (an empty list when it is missing)."""
        k = _key(key)
        return self._descs([k])[k]

    @_guard(_empty_dict)
    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        return self._descs(_keys(keys))

    @_guard(_one)
    def remove(self, key: str, force: bool = False) -> int:
        return _res(self._live().remove([_key(key)], force=bool(force))[0])

    @_guard(_each)
    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        ks = _keys(keys)
        return [_res(r) for r in self._live().remove(ks, force=bool(force))] if ks else []

    @_guard(_one)
    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Remove the objects whose key matches, for literal-prefix patterns: ``^abc``,
        ``^abc.*`` or ``^abc.*$`` (metacharacters in ``abc`` escaped) remove the keys that
        start with ``abc``; the number removed. Any other pattern (valid or not) answers
        -600: the master never evaluates a client's regex (ReDoS)."""
        if not isinstance(regex_pattern, str):
            raise TypeError("regex_pattern must be str")
        try:
            re.compile(regex_pattern)
        except re.error:
            return INVALID_PARAMS
        prefix = literal_prefix(regex_pattern)
        if prefix is None:
            return INVALID_PARAMS
        return int(self._live().remove_prefix(prefix, force=bool(force)))

    @_guard(_one)
    def remove_by_prefix(self, prefix: str, force: bool = False) -> int:
        """kvmesh only (not in Mooncake): remove the objects whose key starts with
        ``prefix``; how many, or a negative code."""
        return int(self._live().remove_prefix(_key(prefix), force=bool(force)))

    @_guard(_one)
    def remove_all(self, force: bool = False) -> int:
        """Remove every object (leased ones too with ``force``); how many."""
        return int(self._live().remove_all(force=bool(force)))

    @_guard(_empty_list)
    def batch_replica_clear(self, keys: list[str], segment_name: str = "") -> list[str]:
        """Drop the objects' copies (those in ``segment_name`` when given: kvmesh keeps an
        object's copies together, so an object with a copy there goes whole); the keys
        cleared. Leased objects are left, as in Mooncake."""
        ks = _keys(keys)
        if not isinstance(segment_name, str):
            raise TypeError("segment_name must be str")
        if not ks:
            return []
        if segment_name:
            with _SEG_LOCK:
                seg = _SEGMENTS.get(segment_name, segment_name)
            res = self._live().replicas(ks)
            ks = [
                k
                for k, r in zip(ks, res)
                if not isinstance(r, E.StoreError)
                and any(s.segment == seg for c in r for s in c.slices)
            ]
            if not ks:
                return []
        res = self._live().remove(ks, force=bool(segment_name))
        return [k for k, r in zip(ks, res) if _res(r) == 0]

    # ------------------------------------------------------------------ tasks (unsupported)

    def create_copy_task(self, key: str, targets: list[str]) -> tuple:
        """Mooncake's master-scheduled replica copy: kvmesh's master never moves bytes.
        ``((0, 0), -1012)``."""
        return ((0, 0), NOT_SUPPORTED)

    def create_move_task(self, key: str, source: str, target: str) -> tuple:
        return ((0, 0), NOT_SUPPORTED)

    def query_task(self, task_id: tuple[int, int]) -> tuple:
        return (None, NOT_SUPPORTED)

    def get_offload_rpc_read_count(self) -> int:
        """Reads Mooncake served from its SSD offload over RPC: kvmesh has none. 0."""
        return 0


def bind_to_numa_node(node: int) -> None:
    """Mooncake pins the calling thread to a NUMA node. kvmesh leaves placement to the OS
    (its segments are shared memory any core may copy): a no-op."""
    _int(node, "node")
