"""``MooncakeDistributedStore`` on :class:`~kvmesh.store.client.StoreClient`: every method of
Mooncake 0.3.13's (and 0.3.14's ``probe_key`` / ``batch_probe_key``), with Mooncake's
argument names, defaults and results.

Results are plain ``int``: 0 for success, bytes read for reads, 1/0 for existence, negative
Mooncake codes (-704 not found, -706 has lease, -600 invalid parameters, -1012 not
supported...). A condition Mooncake reports as a code is never an exception here; a call of
the wrong shape (a ``str`` where Mooncake takes a key list, an unknown keyword) raises
``TypeError``, as pybind11 does in Mooncake. The differences are the compatibility table of
docs/store.md.

The class is this module's setup, lifecycle, segments and buffers, plus one mixin per method
group: :mod:`.put_methods`, :mod:`.get_methods`, :mod:`.query_methods`,
:mod:`.tensor_methods`, :mod:`.tensor_sharded`.

Each store is one Mooncake client: its own master connection and, with a
``global_segment_size``, its own storage node and segment named by :meth:`get_hostname`
(``host:port``), all on the process's one transfer engine. Any number may live in one
process; ``close`` unmounts (the store's objects whose only copy was there go, as in
Mooncake) and ``setup`` may follow again.
"""

from __future__ import annotations

import logging
import random
import threading
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
    _empty_dict,
    _guard,
    _int,
    _keys,
    _NotSetUp,
    _one,
)
from .constants import (
    BUFFER_OVERFLOW,
    INVALID_PARAMS,
    NOT_SUPPORTED,
    SoftPinAction,
    code,
)
from .get_methods import GetMethods
from .put_methods import PutMethods
from .query_methods import QueryMethods
from .tensor_methods import TensorMethods
from .tensor_sharded import ShardedTensorMethods
from .types import (
    ReplicateConfig,
)

__all__ = ["MooncakeDistributedStore", "bind_to_numa_node"]

log = logging.getLogger("kvmesh.store.compat")

SEGMENT_EXISTS = int(E.Code.SEGMENT_ALREADY_EXISTS)
_PORTS = (12300, 14300)  # Mooncake's range for a hostname given without a port

# get_hostname() -> the segment actually mounted (a name taken earlier in the master's
# quarantine gets a suffix), so a preferred_segment naming a store of this process finds it.
_SEGMENTS: dict[str, str] = {}
_SEG_LOCK = threading.Lock()


class MooncakeDistributedStore(
    PutMethods, GetMethods, QueryMethods, TensorMethods, ShardedTensorMethods
):
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

    # ================================================================== shared by the groups

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
            pref = self._segment_named(pref)
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

    def _segment_named(self, name: str) -> str:
        """The segment a ``get_hostname()`` of a store in this process names (the one it
        mounted), else ``name`` itself."""
        with _SEG_LOCK:
            return _SEGMENTS.get(name, name)


def bind_to_numa_node(node: int) -> None:
    """Mooncake pins the calling thread to a NUMA node. kvmesh leaves placement to the OS
    (its segments are shared memory any core may copy): a no-op."""
    _int(node, "node")
