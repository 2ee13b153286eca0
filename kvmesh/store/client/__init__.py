"""``kvmesh.StoreClient``: the synchronous, thread-safe, batch-first client of the store.

Every call takes one key or a list of keys. A list is one RPC to the master (at most one log
entry) plus one transfer-engine batch, and returns a :class:`BatchResults`: one entry per
key, in order -- the single call's value on success, the :class:`~.errors.StoreError` instance
on failure -- so one bad key never fails the batch. A single key raises that error instead.

Data path (the master never sees a byte):

* put: ``PutStart`` allocates PROCESSING replicas -> the engine WRITEs straight from the
  caller's registered buffer into the replicas' segments -> ``PutEnd`` makes them visible
  (``PutRevoke`` frees the keys whose write failed);
* get: ``GetReplicas`` returns COMPLETE replicas under a read lease -> the engine READs into
  the caller's buffer. The lease is counted from *before* the request left (the attempt the
  master answered, not an earlier one lost to an outage), so the client's view expires
  before the master's; a copy that finishes after it answers LeaseExpired for
  that key and its bytes must be ignored (the memory may have been reused).

Zero-copy: :meth:`StoreClient.register_buffer` once, then :meth:`put_from` / :meth:`get_into`
at offsets. The convenience forms (:meth:`put` of bytes, :meth:`get` returning bytes, tensor
helpers on unregistered tensors) go through internal registered staging buffers (one copy).

``BatchResults.transports`` names the transports that moved the batch's bytes.

The package, one job per module: :mod:`.args` (argument normalisation), :mod:`.replies`
(results, request-sized parts, the one fan-out of a master reply), :mod:`.staging` (scratch
buffers of the copying forms), :mod:`.buffers` (registration and address resolution),
:mod:`.moves` (engine batches), :mod:`.writes` (the put protocol), :mod:`.table` and
:mod:`.reads` (the get protocol), :mod:`.meta` (metadata calls). :class:`StoreClient` joins
their call groups and owns the connections.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ...net.security import SecurityConfig
from ...transfer import MemoryRegion, TransferEngine, get_engine
from ..node import StorageNode
from ..rpc import MasterClient
from ..types import ReplicateConfig
from .buffers import Buffers
from .meta import Meta
from .moves import Moves
from .reads import Reads
from .replies import MAX_KEY_BYTES_PER_RPC, MAX_KEYS_PER_RPC, BatchResults, Removed
from .reservation import Reservations
from .staging import Staging
from .writes import Writes

__all__ = ["MAX_KEYS_PER_RPC", "MAX_KEY_BYTES_PER_RPC", "BatchResults", "Removed", "StoreClient"]


class StoreClient(Writes, Reads, Meta, Buffers, Moves):
    """Client of a store cluster (or of an embedded single-host one).

    ``master``: ``"host:port"``, ``"h1:p1,h2:p2,h3:p3"`` or a list of store RPC addresses of
    the master replicas; ``None`` starts (or reuses) this process's embedded master (see
    :mod:`kvmesh.store.embedded_master`) and contributes a local segment. ``segment_size``: bytes
    this process contributes as a storage node (default 0 with a master address, 256 MiB
    embedded). ``replica_num``: copies per object (on distinct nodes). ``token``/``security``:
    the cluster's shared secret (default: ``KVMESH_TOKEN`` etc. from the environment).
    ``spin_us``: how long a master call busy-polls for its reply before blocking (default
    ``$KVMESH_SPIN_US`` or 100 us; 0 = off; see :class:`~.rpc.MasterClient`).
    """

    def __init__(
        self,
        master: str | list[str] | None = None,
        *,
        segment_size: int | None = None,
        replica_num: int = 1,
        token: str | None = None,
        security: SecurityConfig | None = None,
        engine: TransferEngine | None = None,
        timeout: float = 15.0,
        transfer_timeout: float = 30.0,
        heartbeat_s: float = 2.0,
        spin_us: float | None = None,
    ) -> None:
        self._embedded = None
        sec = security
        if sec is None and token is not None:
            sec = SecurityConfig(token=token)
        if master is None:
            from ..embedded_master import acquire_embedded

            self._embedded = acquire_embedded()
            addrs = [self._embedded.address]
            sec = self._embedded.security
            if segment_size is None:
                segment_size = int(os.environ.get("KVMESH_STORE_SEGMENT", str(256 << 20)))
        else:
            addrs = [
                a.strip()
                for a in (master.split(",") if isinstance(master, str) else master)
                if a.strip()
            ]
            if sec is None:
                sec = SecurityConfig.from_env()
        self.engine = engine if engine is not None else get_engine()
        self.rpc = MasterClient(
            addrs,
            sec,
            name=f"store-client-{self.engine.node_id}",
            # With a segment this process is also storage node <engine node id>: it needs
            # that node's credential (or the secret), not only a client's.
            node_id=self.engine.node_id if segment_size else None,
            timeout=timeout,
            spin_us=spin_us,
        )
        self.config = ReplicateConfig(replica_num=replica_num, writer_host=self.engine.host_id)
        self.transfer_timeout = transfer_timeout
        self._buffers: dict[int, MemoryRegion] = {}
        self._buf_lock = threading.Lock()
        self._staging = Staging(self.engine)
        self._reserved = Reservations()
        self._seg_lock = threading.Lock()
        self._segments: dict[tuple[str, str], Any] = {}
        self.last_transports: list[str] = []
        # "read:shm" -> [batches, bytes]: what moved over which transport (this client).
        self.stats: dict[str, list[int]] = {}
        self._closed = False
        self.node: StorageNode | None = None
        if segment_size:
            try:
                self.node = StorageNode(
                    self.rpc, segment_size, engine=self.engine, heartbeat_s=heartbeat_s
                ).start()
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """Unmount this process's segment (if any), release buffers and connections."""
        if self._closed:
            return
        self._closed = True
        self._release_reservations()
        if self.node is not None:
            self.node.close()
        self._staging.close()
        with self._buf_lock:
            regions, self._buffers = list(self._buffers.values()), {}
        for r in regions:
            try:
                self.engine.unregister(r)
            except Exception:  # noqa: BLE001
                pass
        self.rpc.close()
        if self._embedded is not None:
            from ..embedded_master import release_embedded

            release_embedded(self._embedded)
            self._embedded = None

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
