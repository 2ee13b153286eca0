"""TransferEngine: one per process; registers memory, publishes segments, moves bytes.

The engine wires the pieces together and owns every thread: the control server (accept +
one thread per connection), the monitor (peer liveness), and the worker pool. All of them
block when idle. Transports are created once, in the preference order of
``transports.REGISTRY`` filtered by configuration, and chosen per (local memory kind,
remote segment) on first use (docs/transfer.md, "Transport selection").

Use :func:`get_engine` / :func:`init_engine` for the process-wide shared engine (the store
client and both SGLang plugins must share one).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np

from . import disk as _disk
from . import fastcopy, fence
from . import protocol as P
from . import select as _select
from . import transports as _transports
from .batch import Batch, BatchContext, BatchResult, validate_requests
from .control import ControlServer, Identity, Monitor, PeerClient
from .errors import (
    EngineClosed,
    InvalidArgument,
    InvalidLength,
    NotRegistered,
    SegmentNotFound,
    TensorMismatch,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
)
from .executor import Executor
from .fastcopy import bulk_slot
from .memory import (
    MemoryRegion,
    RegionIndex,
    SharedBuffer,
    describe_object,
    find_live_region,
    shared_buffer_at,
    sweep_dead_shared,
)
from .ranges import as_int64, as_op, as_requests, check_ranges
from .segment import RemoteSegment, RouteHandle, SegmentTable
from .transports.base import TransferJob, Transport, TransportContext
from .transports.tcp import TcpServer
from .types import BatchState, EngineConfig, MemoryKind, Op, SegmentDescriptor, TransportKind

log = logging.getLogger("kvmesh.transfer")

_swept = False
_sweep_lock = threading.Lock()
_DISK = MemoryKind.DISK


def detect_host_id() -> str:
    """Identity of "this host" for locality: same id <=> the same kernel and ``/dev/shm``.

    Hostname alone is not enough (containers share it or not at will); the boot id names the
    kernel and the device number of ``/dev/shm`` tells apart tmpfs mounts of containers that
    do not share shared memory.
    """
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    try:
        st = os.stat("/dev/shm")
        parts.append(f"{st.st_dev}:{st.st_ino}")
    except OSError:
        parts.append("no-shm")
    digest = hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]
    return f"{parts[0]}-{digest}"


def _tensor_meta(obj: Any) -> tuple[str, tuple[int, ...], int]:
    """(dtype name, shape, nbytes) of a torch tensor or numpy array."""
    if isinstance(obj, np.ndarray):
        return obj.dtype.name, tuple(obj.shape), obj.nbytes
    if type(obj).__module__.startswith("torch"):
        return (
            str(obj.dtype).removeprefix("torch."),
            tuple(obj.shape),
            obj.numel() * obj.element_size(),
        )
    raise InvalidArgument(f"expected a torch tensor or numpy array, got {type(obj).__name__}")


def _one(local_offset: int, remote_offset: int, length: int) -> tuple[np.ndarray, ...]:
    return (
        as_int64("local_offset", (local_offset,), copy=False),
        as_int64("remote_offset", (remote_offset,), copy=False),
        as_int64("length", (length,), copy=False),
    )


def _one_pass(handles: list[RouteHandle]) -> bool:
    """Whether every job of a call goes through one transport that runs a call's jobs in one
    pass (``execute_many``)."""
    t = handles[0].transport
    return getattr(t, "execute_many", None) is not None and all(h.transport is t for h in handles)


def _failed(h: RouteHandle, what: str, exc: Exception) -> TransferError:
    """A transport's unexpected exception as the call's error."""
    return TransferError(f"{h.transport.kind.value} transport failed {what}: {exc!r}")


class TransferEngine:
    """Moves bytes between registered memory of this process and segments of peers.

    ``TransferEngine(node_id=None, listen="127.0.0.1:0", config=None)``: ``config`` defaults
    to :meth:`EngineConfig.from_env`; ``node_id`` and ``listen`` override it. The control
    server starts at once; ``address`` is what peers pass to :meth:`open_segment`.
    """

    def __init__(
        self,
        node_id: str | None = None,
        listen: str | None = None,
        config: EngineConfig | None = None,
    ) -> None:
        cfg = config if config is not None else EngineConfig.from_env()
        changes = {k: v for k, v in (("node_id", node_id), ("listen", listen)) if v is not None}
        if changes:
            cfg = msgspec.structs.replace(cfg, **changes)
        self.config = cfg
        self.pid = os.getpid()
        self.engine_id = secrets.token_hex(8)
        self.host_id = cfg.host_id or detect_host_id()
        self.node_id = cfg.node_id or f"{socket.gethostname()}-{self.pid}-{self.engine_id[:4]}"
        self._lock = threading.RLock()
        self._closed = False
        self._regions = RegionIndex()
        self._owned_buffers: dict[int, SharedBuffer] = {}  # region id -> buffer we allocated
        self._disks: dict[int, _disk.DiskSegment] = {}  # region id -> registered disk segment
        self._table = SegmentTable()
        self._peers: dict[str, PeerClient] = {}
        self._peer_locks: dict[str, threading.Lock] = {}
        self._remote: dict[tuple[str, str], RemoteSegment] = {}
        # locate_many's sorted table of a peer's segments, valid while _remote_gen is
        # unchanged (bumped under _lock by every change of _remote): rebuilding it per call
        # (a pass over every remote segment, a sort, two arrays) was ~0.3 ms of a PD
        # batch_transfer_sync once the pools' ~260 regions were published.
        self._remote_gen = 0
        self._locate_cache: dict[str, tuple[int, list[RemoteSegment], np.ndarray, np.ndarray]] = {}
        self._removed: set[int] = set()
        self._monitor: Monitor | None = None
        # Counted under a lock: batches complete on many threads, and ``+=`` on a dict item
        # is not atomic between them (the pattern of fastcopy's copy gate).
        self._stats_lock = threading.Lock()
        self._stats = {"batches": 0}
        self._sweep()

        self._ctx = TransportContext(
            engine_id=self.engine_id,
            node_id=self.node_id,
            host_id=self.host_id,
            pid=self.pid,
            config=cfg,
            call=self._transport_call,
            find_region=find_live_region,
            peer=self.peer,
        )
        self._transports: list[Transport] = []
        self.transport_status: dict[str, str | None] = {}  # kind -> None (enabled) or why not
        self._start_transports()
        fastcopy.choice()  # the copy kernel's probe (once per process), before any timed copy
        self._executor = Executor(cfg.workers)
        self._batch_ctx = BatchContext(
            cfg,
            check_open=self._check_open,
            is_registered=self._regions.__contains__,
            route=self._route,
            submit=self._executor.submit,
            note_batch=self._note_batch,
        )
        try:
            tcp_server = TcpServer(self._table.lookup, cfg)  # the TCP data path's owner side
            self._server = ControlServer(
                cfg.listen,
                Identity(self.node_id, self.engine_id, self.host_id),
                cfg,
                lookup=self._table.lookup,
                list_segments=self._table.list,
                call=self._handle_call,
                handlers=tcp_server.handlers(),
                max_frame=tcp_server.max_frame,
            )
        except BaseException:
            self._executor.close()
            for t in self._transports:
                t.close()
            raise
        self.address = self._server.address
        log.info(
            "transfer engine %s on %s (host %s), transports %s",
            self.node_id,
            self.address,
            self.host_id,
            [t.kind.value for t in self._transports],
        )

    # --- set-up ---------------------------------------------------------------------------
    def _sweep(self) -> None:
        global _swept
        if not self.config.shm_sweep:
            return
        with _sweep_lock:
            if _swept:
                return
            _swept = True
        removed = sweep_dead_shared()
        if removed:
            log.info("removed %d shared-memory files left by dead processes", len(removed))

    def _start_transports(self) -> None:
        cfg = self.config
        for kind in _transports.REGISTRY:
            if not cfg.transport_enabled(kind):
                self.transport_status[kind.value] = "disabled by configuration"
                continue
            cls, why = _transports.load(kind)
            if cls is None:
                self.transport_status[kind.value] = why
                continue
            try:
                self._transports.append(cls(self._ctx))
                self.transport_status[kind.value] = None
            except Exception as exc:
                log.warning("transport %s failed to start: %r", kind.value, exc)
                self.transport_status[kind.value] = f"failed to start: {exc!r}"
        if cfg.transport is not None and not self._transports:
            raise TransportUnavailable(
                f"forced transport {cfg.transport.value!r} is unavailable: "
                f"{self.transport_status.get(cfg.transport.value)}"
            )

    @property
    def transports(self) -> list[TransportKind]:
        """Enabled transports, in preference order."""
        return [t.kind for t in self._transports]

    def transport(self, kind: TransportKind | str) -> Transport | None:
        """The running transport object of ``kind`` (None if not enabled)."""
        kind = TransportKind(kind)
        for t in self._transports:
            if t.kind is kind:
                return t
        return None

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed(f"transfer engine {self.node_id} is closed")

    # --- memory ---------------------------------------------------------------------------
    def register(
        self, obj: Any, *, name: str | None = None, kind: MemoryKind | None = None
    ) -> MemoryRegion:
        """Register a numpy array, torch tensor (CPU or CUDA), bytearray/memoryview or SharedBuffer.

        Register once and reuse the handle: that is the fast path. With ``name`` the region is
        also published as a segment. Memory inside a :class:`SharedBuffer` of this process is
        detected and registered as SHM, so same-host peers copy into it directly.
        """
        ptr, size, k, device, owner = describe_object(obj, kind)
        return self.register_raw(ptr, size, k, device, owner=owner, name=name)

    def register_raw(
        self,
        ptr: int,
        size: int,
        kind: MemoryKind | str = MemoryKind.DRAM,
        device: int = -1,
        *,
        owner: Any = None,
        name: str | None = None,
    ) -> MemoryRegion:
        """Register ``size`` bytes at address ``ptr``; ``owner`` is kept alive meanwhile."""
        self._check_open()
        kind = MemoryKind(kind)
        if not isinstance(ptr, int) or ptr <= 0:
            raise InvalidArgument(f"bad address {ptr!r}")
        if not isinstance(size, int) or size <= 0:
            raise InvalidLength(f"registered size must be positive, got {size!r}")
        shm = None
        if kind.is_host:
            shm = shared_buffer_at(ptr, size)
            if shm is not None:
                kind = MemoryKind.SHM
            elif kind is MemoryKind.SHM:
                raise InvalidArgument(
                    "SHM regions must lie inside a SharedBuffer (use alloc_shared)"
                )
        region = MemoryRegion(ptr, size, kind, device, owner, shm)
        done: list[Transport] = []
        try:
            for t in self._transports:
                t.on_register(region)
                done.append(t)
        except BaseException:
            for t in done:
                t.on_unregister(region)
            region.close(0)
            raise
        self._regions.add(region)
        if name is not None:
            try:
                self.publish(region, name)
            except BaseException:
                self.unregister(region)
                raise
        return region

    def alloc_shared(self, size: int, *, name: str | None = None) -> MemoryRegion:
        """Allocate ``size`` bytes of shared memory, registered (and published as ``name``).

        ``region.array()`` is a numpy view of it. Same-host peers map it and copy directly;
        unregistering frees it.
        """
        self._check_open()
        buf = SharedBuffer.create(size, populate=self.config.shm_populate)
        try:
            region = self.register_raw(buf.addr, size, MemoryKind.SHM, owner=buf)
        except BaseException:
            buf.close()
            raise
        self._owned_buffers[region.region_id] = buf
        if name is not None:
            try:
                self.publish(region, name)
            except BaseException:
                self.unregister(region)
                raise
        return region

    def unregister(self, region: MemoryRegion, *, timeout: float = 10.0) -> None:
        """Unpublish and unregister ``region``; waits (bounded) for jobs still using it.

        When this returns no job of this or any same-host peer process touches the memory
        any more ("Memory lifetime" in docs/transfer.md). ``TransferTimeout`` means some job
        still may: the region stays registered (closed to new jobs) and its memory must not
        be reused; calling again waits again.
        """
        if isinstance(region, _disk.DiskSegment):
            return self._unregister_disk(region, timeout)
        if region not in self._regions:
            raise NotRegistered(f"{region!r} is not registered with this engine")
        for name in self._table.names_of(region):
            self.unpublish(name)
        self._server.end_users_of(region)  # a stalled peer's request must not pin it
        end = time.monotonic() + timeout
        region.close(timeout)
        fence.revoke(region.region_id, max(0.0, end - time.monotonic()))
        self._regions.remove(region)
        for t in self._transports:
            try:
                t.on_unregister(region)
            except Exception:
                log.exception("transport %s failed to unregister %r", t.kind.value, region)
        buf = self._owned_buffers.pop(region.region_id, None)
        if buf is not None:
            buf.close()

    # --- disk segments (disk.py) ------------------------------------------------------------
    def register_disk(
        self,
        path: str | os.PathLike[str],
        size: int,
        *,
        name: str,
        direct: bool | None = None,
        durable: bool = False,
        file_bytes: int | None = None,
        depth: int = _disk.DEPTH,
    ) -> _disk.DiskSegment:
        """Open (or create, keeping existing bytes) a disk segment and publish it as ``name``.

        ``path`` is a file or an existing directory (files of ``file_bytes`` in it); its space
        is reserved now. ``direct``: O_DIRECT where the filesystem allows (``None``), required
        (``True``) or never (``False``). ``durable``: every write is fdatasync-ed before it is
        acknowledged (else call :meth:`sync_segment`). ``depth``: requests one call keeps in
        flight on the device (4). ``InvalidArgument`` says why a path is
        unusable (not writable, too little space, in use by another process).
        """
        self._check_open()
        seg = _disk.open_disk(
            path, size, direct=direct, durable=durable, file_bytes=file_bytes, depth=depth
        )
        try:
            desc = self._new_descriptor(
                name, region_id=seg.region_id, kind=MemoryKind.DISK, base=0, size=seg.size
            )
            seg.name, seg.seg_id = name, desc.seg_id
            self._table.add(desc, seg)  # type: ignore[arg-type]
        except BaseException:
            seg.close(0)
            raise
        self._disks[seg.region_id] = seg
        return seg

    def _unregister_disk(self, seg: _disk.DiskSegment, timeout: float) -> None:
        if self._disks.get(seg.region_id) is not seg:
            raise NotRegistered(f"{seg!r} is not registered with this engine")
        for name in self._table.names_of(seg):  # type: ignore[arg-type]
            self.unpublish(name)
        self._server.end_users_of(seg)  # a stalled peer's request must not pin it
        seg.close(timeout)
        del self._disks[seg.region_id]

    def sync_segment(self, remote: RemoteSegment, *, timeout: float | None = None) -> None:
        """Make every acknowledged write to disk segment ``remote`` durable (fdatasync), here
        or through its owner."""
        self._disk_call(
            remote, _disk.DiskCall("sync", remote.desc.region_id, remote.desc.seg_id), 0, timeout
        )

    def checksum_segment(
        self, remote: RemoteSegment, offsets: Any, lengths: Any, *, timeout: float | None = None
    ) -> np.ndarray:
        """crc32c (``uint32``) of each range of disk segment ``remote``, computed where the
        bytes are (no bytes move)."""
        offs, _, lens = as_requests(offsets, offsets, lengths, names=("offsets", "offsets"))
        d = remote.desc
        check_ranges(f"checksum on segment {d.name!r}", lens, (offs, d.size, d.name))
        call = _disk.DiskCall(
            "checksum",
            d.region_id,
            d.seg_id,
            offs.astype("<u8").tobytes(),
            lens.astype("<u8").tobytes(),
        )
        return self._disk_call(remote, call, len(lens), timeout)

    def _disk_call(
        self, remote: RemoteSegment, call: _disk.DiskCall, n: int, timeout: float | None
    ) -> np.ndarray:
        self._check_open()
        if not isinstance(remote, RemoteSegment) or remote.kind is not MemoryKind.DISK:
            raise InvalidArgument(f"{remote!r} is not a disk segment")
        if remote.stale_reason is not None:
            raise SegmentNotFound(f"segment {remote.name!r} is gone: {remote.stale_reason}")
        payload = _disk.encode_call(call)
        if remote.desc.engine_id == self.engine_id:
            reply = _disk.handle_call(payload, self.config)
        else:
            reply = remote.peer.call(TransportKind.DISK.value, payload, timeout)
        return _disk.decode_reply(reply, n)

    def regions(self) -> list[MemoryRegion]:
        return self._regions.all()

    def find_region(self, ptr: int, length: int = 1) -> tuple[MemoryRegion, int]:
        """The registered region holding ``[ptr, ptr + length)`` and the offset of ``ptr``."""
        return self._regions.find(ptr, length)

    def find_regions(
        self, ptrs: Any, lengths: Any
    ) -> tuple[list[MemoryRegion], np.ndarray, np.ndarray]:
        """Vectorised :meth:`find_region`: ``(regions, region index per address, offsets)``."""
        return self._regions.find_many(np.asarray(ptrs), np.asarray(lengths))

    # --- segments -------------------------------------------------------------------------
    def publish(
        self, region: MemoryRegion, name: str, *, meta: dict[str, str] | None = None
    ) -> SegmentDescriptor:
        """Publish a registered region as segment ``name``; returns its descriptor."""
        self._check_open()
        if region not in self._regions:
            raise NotRegistered(f"{region!r} is not registered with this engine")
        shm = region.shm
        desc = self._new_descriptor(
            name,
            region_id=region.region_id,
            kind=region.kind,
            device=region.device,
            base=region.ptr,
            size=region.size,
            shm_name=shm.name if shm is not None else None,
            shm_offset=region.shm_offset,
            shm_size=shm.size if shm is not None else 0,
            fence=fence.publish(region.region_id),
            meta=dict(meta or {}),
        )
        fields: dict[str, Any] = {}
        for t in self._transports:
            fields.update(t.describe(region))
        if fields:
            desc = msgspec.structs.replace(desc, **fields)
        self._table.add(desc, region)
        region.name = name
        return desc

    def _new_descriptor(self, name: str, **fields: Any) -> SegmentDescriptor:
        """A descriptor of a new segment ``name`` of this engine (a fresh ``seg_id``)."""
        if not name:
            raise InvalidArgument("segment names must be non-empty")
        return SegmentDescriptor(
            name=name,
            seg_id=secrets.randbits(63),
            node_id=self.node_id,
            host_id=self.host_id,
            engine_id=self.engine_id,
            pid=self.pid,
            control=self.address,
            **fields,
        )

    def unpublish(self, name: str) -> None:
        """Stop publishing ``name``; peers that opened it are told (their handles go stale)."""
        desc, region = self._table.remove(name)
        if region.name == name:
            region.name = None
        if not self._closed:
            self._server.notify(P.SegmentRemoved(name, desc.seg_id))

    def segments(self) -> list[SegmentDescriptor]:
        """Descriptors of the segments this engine publishes."""
        return self._table.list()

    # --- peers ----------------------------------------------------------------------------
    def peer(self, address: str) -> PeerClient:
        """The connected client for the engine at ``address`` (connects on first use)."""
        self._check_open()
        p = self._peers.get(address)
        if p is not None and p.liveness.alive:
            return p
        with self._lock:
            lock = self._peer_locks.setdefault(address, threading.Lock())
        with lock:
            p = self._peers.get(address)
            if p is not None and p.liveness.alive:
                return p
            p = PeerClient(
                address, Identity(self.node_id, self.engine_id, self.host_id), self.config
            )
            try:
                sock = p.open_watch()
                with self._lock:
                    self._check_open()
                    if self._monitor is None:
                        self._monitor = Monitor(self._on_segment_removed, self._on_peer_dead)
                    self._monitor.watch(sock, p)
            except BaseException:
                p.close()
                raise
            self._peers[address] = p
            return p

    def ping(self, address: str, timeout: float | None = None) -> float:
        """Round-trip time to the engine at ``address``, in seconds."""
        return self.peer(address).ping(timeout)

    def list_segments(self, address: str) -> list[SegmentDescriptor]:
        """Descriptors of every segment the engine at ``address`` publishes."""
        return self.peer(address).list_segments()

    def open_segment(self, address: str, name: str, *, refresh: bool = False) -> RemoteSegment:
        """A handle on segment ``name`` of the engine at ``address`` (cached per peer)."""
        peer = self.peer(address)
        key = (peer.engine_id, name)
        rs = self._remote.get(key)
        if rs is not None and not refresh and rs.stale_reason is None and rs.peer is peer:
            return rs
        desc = peer.get_segment(name)
        return self._adopt(peer, desc)

    def _adopt(self, peer: PeerClient, desc: SegmentDescriptor) -> RemoteSegment:
        key = (peer.engine_id, desc.name)
        with self._lock:
            rs = self._remote.get(key)
            if (
                rs is not None
                and rs.desc.seg_id == desc.seg_id
                and rs.stale_reason is None
                and rs.peer is peer
            ):
                return rs
            new = RemoteSegment(desc, peer)
            if desc.seg_id in self._removed:  # removal notice overtook our lookup
                new.stale_reason = "removed by its owner"
            else:
                self._remote[key] = new
                self._remote_gen += 1
        if rs is not None and rs.desc.seg_id != desc.seg_id:
            rs.stale_reason = rs.stale_reason or "replaced by its owner"
            rs.close_routes()
        return new

    def locate(self, address: str, remote_ptr: int, length: int = 1) -> tuple[RemoteSegment, int]:
        """The peer segment holding raw peer address ``remote_ptr`` and the offset in it.

        For address-based APIs (the Mooncake-style PD shim): the peer's segment list is
        fetched once and refreshed when an address is not found.
        """
        segs, idx, offs = self.locate_many(
            address, np.array([remote_ptr], np.uint64), np.array([length], np.uint64)
        )
        return segs[int(idx[0])], int(offs[0])

    def locate_many(
        self, address: str, remote_ptrs: Any, lengths: Any
    ) -> tuple[list[RemoteSegment], np.ndarray, np.ndarray]:
        """Vectorised :meth:`locate`: ``(segments, segment index per address, offsets)``."""
        ptrs = np.asarray(remote_ptrs, dtype=np.uint64)
        lens = np.asarray(lengths, dtype=np.uint64)
        peer = self.peer(address)
        hit = self._locate_cache.get(peer.engine_id)
        if hit is not None and hit[0] == self._remote_gen:
            _, segs, starts, ends = hit
            i = np.searchsorted(starts, ptrs, side="right").astype(np.int64) - 1
            safe = np.maximum(i, 0)
            if ((i >= 0) & (ptrs + lens <= ends[safe])).all():
                return segs, safe, ptrs - starts[safe]
        for attempt in (0, 1):
            gen = self._remote_gen  # read before the table: a change meanwhile voids the entry
            # Disk segments have no addresses (base 0): raw pointers never name them.
            segs = [
                s
                for (eid, _), s in list(self._remote.items())
                if eid == peer.engine_id and s.stale_reason is None and s.kind is not _DISK
            ]
            if attempt == 1 or not segs:
                segs = [self._adopt(peer, d) for d in peer.list_segments() if d.kind is not _DISK]
                segs = [s for s in segs if s.stale_reason is None]
                gen = -1  # adopted segments may be outside _remote (removed meanwhile)
            if not segs:
                continue
            segs.sort(key=lambda s: s.desc.base)
            starts = np.array([s.desc.base for s in segs], dtype=np.uint64)
            ends = np.array([s.desc.base + s.desc.size for s in segs], dtype=np.uint64)
            if gen >= 0:
                self._locate_cache[peer.engine_id] = (gen, segs, starts, ends)
            i = np.searchsorted(starts, ptrs, side="right").astype(np.int64) - 1
            safe = np.maximum(i, 0)
            ok = (i >= 0) & (ptrs + lens <= ends[safe])
            if ok.all():
                return segs, safe, ptrs - starts[safe]
        bad = int(np.flatnonzero(~ok)[0]) if len(ptrs) and segs else 0
        raise SegmentNotFound(
            f"peer {address} publishes no segment "
            f"holding address 0x{int(ptrs[bad]):x}+{int(lens[bad])}"
        )

    # --- transfers ------------------------------------------------------------------------
    def batch(self) -> Batch:
        """A new, empty batch (see :class:`Batch`)."""
        self._check_open()
        return Batch(self._batch_ctx)

    def transfer(
        self,
        op: Op | str,
        local: MemoryRegion,
        local_offsets: Any,
        remote: RemoteSegment,
        remote_offsets: Any,
        lengths: Any,
        *,
        timeout: float | None = None,
    ) -> BatchResult:
        """Synchronous batch: move the requests and return when done (raises on failure).

        The calling thread does the copy or the socket I/O itself (no thread hand-off); a
        batch larger than ``split_bytes`` is cut into parts that the worker threads share.
        """
        lo, ro, ln = as_requests(local_offsets, remote_offsets, lengths)
        return self._sync(as_op(op), local, remote, lo, ro, ln, timeout)

    def transfer_grouped(
        self,
        op: Op | str,
        regions: Sequence[MemoryRegion],
        reg: np.ndarray,
        lo: np.ndarray,
        segments: Sequence[RemoteSegment],
        seg: np.ndarray,
        ro: np.ndarray,
        ln: np.ndarray,
        *,
        timeout: float | None = None,
    ) -> GroupedResult:
        """Requests as columns over several regions and segments: request ``r`` moves
        ``ln[r]`` bytes between ``regions[reg[r]]`` at ``lo[r]`` and ``segments[seg[r]]`` at
        ``ro[r]``. Grouped here per (region, segment) pair (one stable sort), moved as one
        batch; never raises for a failed request. Returns per request whether it moved and
        the batches' results. When the batch is refused before anything moved (a group whose
        route cannot be used), the groups run one by one, each failing alone."""
        op = as_op(op)
        n = len(ln)
        ok = np.zeros(n, bool)
        if not n:
            return GroupedResult(ok, [])
        reg, seg = np.asarray(reg, np.int64), np.asarray(seg, np.int64)
        try:
            res = self._move_groups(op, regions, reg, lo, segments, seg, ro, ln, timeout)
        except TransferError as e:
            # Refused (a group whose route cannot be used) or failed part-way: each group
            # alone, so that one bad pair fails only its own requests (a READ or WRITE of
            # the same bytes again is harmless).
            log.info("engine: a grouped %s failed (%s); its groups run one by one", op.value, e)
        else:
            ok[:] = True
            return GroupedResult(ok, [res])
        order, cuts = pair_groups(reg, seg, len(segments))
        results: list[BatchResult] = []
        for a, z in zip(cuts[:-1], cuts[1:]):
            at = order[a:z]
            try:
                res = self.transfer(
                    op, regions[int(reg[at[0]])], lo[at], segments[int(seg[at[0]])], ro[at],
                    ln[at], timeout=timeout,
                )  # fmt: skip
            except (TransferError, OSError, ValueError) as e:
                log.info("engine: a %s group failed: %s", op.value, e)
                continue
            ok[at] = True
            results.append(res)
        return GroupedResult(ok, results, True)

    def _move_groups(
        self,
        op: Op,
        regions: Sequence[MemoryRegion],
        reg: np.ndarray,
        lo: Any,
        segments: Sequence[RemoteSegment],
        seg: np.ndarray,
        ro: Any,
        ln: Any,
        timeout: float | None,
        *,
        checked: bool = False,
    ) -> BatchResult:
        """The one grouping of column requests (:meth:`transfer_grouped`,
        :meth:`transfer_by_address`): per (region, segment) pair in one stable sort, requests
        adjacent on both sides merged, every route held before any byte moves, then run in
        this thread when the transports allow (one job per pair), else as one Batch. Raises
        on failure. ``checked``: every range was resolved inside its region and segment
        already (only registration and liveness are checked here)."""
        lo, ro, ln = (np.asarray(x, np.int64) for x in (lo, ro, ln))
        requests = len(ln)
        order, cuts = pair_groups(reg, seg, len(segments))
        if len(cuts) > 2:
            reg, lo, seg, ro, ln = reg[order], lo[order], seg[order], ro[order], ln[order]
        groups = []
        for a, z in zip(cuts[:-1], cuts[1:]):
            local, remote = regions[int(reg[a])], segments[int(seg[a])]
            if not isinstance(local, MemoryRegion) or not isinstance(remote, RemoteSegment):
                raise InvalidArgument("requests need registered regions and open segments")
            glo, gro, gln = lo[a:z], ro[a:z], ln[a:z]
            nb = validate_requests(
                self._batch_ctx, op, local, remote, glo, gro, gln, ranges_checked=checked
            )
            # Merge requests adjacent on both sides (what each job's coalesced() would do;
            # the runs lie inside the ranges checked above).
            run = (glo[:-1] + gln[:-1] == glo[1:]) & (gro[:-1] + gln[:-1] == gro[1:])
            if run.any():
                starts = np.flatnonzero(np.concatenate(([True], ~run)))
                glo, gro, gln = glo[starts], gro[starts], np.add.reduceat(gln, starts)
            groups.append(
                (local, remote, glo.view(np.uint64), gro.view(np.uint64), gln.view(np.uint64), nb)
            )
        handles = [self._route(g[0], g[1]) for g in groups]  # every route before any byte
        cfg = self.config
        total = sum(g[5] for g in groups)
        if all(h.transport.inline_ok for h in handles) and (
            total <= cfg.split_bytes or all(g[5] <= cfg.inline_bytes for g in groups)
        ):
            # What a sync Batch would run in this thread anyway (one job per group, in order),
            # without its per-request status and task bookkeeping (issue 9: <= 1 ms per call).
            return self._run_inline(op, groups, handles, requests, timeout, coalesced=True)
        if (
            op is Op.WRITE
            and len(groups) > 1
            and handles[0].transport.pipelined_writes
            and all(h.route is handles[0].route for h in handles)
            and all(g[5] <= cfg.split_bytes for g in groups)
        ):
            # Many small WRITEs to one TCP peer (a PD request: one job per layer buffer): one
            # connection carries them back to back from this thread (Transport.execute_writes)
            # instead of a worker hand-off and a round trip each.
            return self._run_inline(
                op, groups, handles, requests, timeout, coalesced=True, pipelined=True
            )
        b = Batch(self._batch_ctx)
        try:
            for local, remote, glo, gro, gln, _ in groups:
                b.add_many(op, local, glo.view(np.int64), remote, gro.view(np.int64), gln)
            b.submit(timeout, _sync=True, _ranges_checked=True)  # checked above
            res = b.wait()
        finally:
            b.free()
        return msgspec.structs.replace(res, requests=requests)  # as the caller counts them

    def read(
        self,
        local: MemoryRegion,
        local_offset: int,
        remote: RemoteSegment,
        remote_offset: int,
        length: int,
        *,
        timeout: float | None = None,
    ) -> BatchResult:
        """READ one range of ``remote`` into ``local`` (synchronous)."""
        return self._sync(
            Op.READ, local, remote, *_one(local_offset, remote_offset, length), timeout
        )

    def write(
        self,
        local: MemoryRegion,
        local_offset: int,
        remote: RemoteSegment,
        remote_offset: int,
        length: int,
        *,
        timeout: float | None = None,
    ) -> BatchResult:
        """WRITE one range of ``local`` into ``remote`` (synchronous)."""
        return self._sync(
            Op.WRITE, local, remote, *_one(local_offset, remote_offset, length), timeout
        )

    def transfer_by_address(
        self,
        op: Op | str,
        address: str,
        local_ptrs: Any,
        remote_ptrs: Any,
        lengths: Any,
        *,
        timeout: float | None = None,
    ) -> BatchResult:
        """Synchronous batch addressed by raw pointers (Mooncake-style ``batch_transfer_sync``).

        ``local_ptrs`` must lie in memory registered here, ``remote_ptrs`` in segments the
        engine at ``address`` publishes (raw addresses in the owner's process). Requests are
        resolved and grouped with vectorised lookups, then moved as one batch.
        """
        op = as_op(op)
        lp, rp, ln = as_requests(
            local_ptrs, remote_ptrs, lengths, names=("local_ptrs", "remote_ptrs")
        )
        if len(ln) == 0:
            return BatchResult(
                state=BatchState.DONE, requests=0, nbytes=0, failed=0, transports=[], elapsed_s=0.0
            )
        if int(ln.min()) <= 0:
            raise InvalidLength(f"request length must be positive, got {int(ln.min())}")
        if int(lp.min()) <= 0 or int(rp.min()) <= 0:
            raise InvalidArgument("addresses must be positive")
        regs, ri, lo = self._regions.find_many(lp.view(np.uint64), ln.view(np.uint64))
        segs, si, ro = self.locate_many(address, rp.view(np.uint64), ln.view(np.uint64))
        lo, ro, ri = lo.astype(np.int64), ro.astype(np.int64), ri.astype(np.int64)
        if int(ri.min()) == int(ri.max()) and int(si.min()) == int(si.max()):
            # one local region, one segment: the lean path
            return self._sync(op, regs[int(ri[0])], segs[int(si[0])], lo, ro, ln, timeout)
        # The ranges were resolved inside their regions and segments by the lookups above.
        return self._move_groups(op, regs, ri, lo, segs, si, ro, ln, timeout, checked=True)

    def _sync(
        self,
        op: Op,
        local: MemoryRegion,
        remote: RemoteSegment,
        lo: np.ndarray,
        ro: np.ndarray,
        ln: np.ndarray,
        timeout: float | None,
    ) -> BatchResult:
        # The lean path of the latency-bound case: no Batch, no Task, no status array.
        self._check_open()
        if not isinstance(local, MemoryRegion):
            raise NotRegistered(
                f"local memory must be a MemoryRegion from register(), got {type(local).__name__}"
            )
        if not isinstance(remote, RemoteSegment):
            raise InvalidArgument(
                f"remote must be a RemoteSegment from open_segment(), got {type(remote).__name__}"
            )
        nbytes = validate_requests(self._batch_ctx, op, local, remote, lo, ro, ln)
        if nbytes > self.config.split_bytes and len(ln) > 1:
            b = Batch(self._batch_ctx)
            try:
                b.add_many(op, local, lo, remote, ro, ln)
                b.submit(timeout, _sync=True)
                return b.wait()
            finally:
                b.free()
        group = (local, remote, lo.view(np.uint64), ro.view(np.uint64), ln.view(np.uint64), nbytes)
        return self._run_inline(op, [group], [self._route(local, remote)], len(ln), timeout)

    def _run_inline(
        self,
        op: Op,
        groups: list[tuple[MemoryRegion, RemoteSegment, np.ndarray, np.ndarray, np.ndarray, int]],
        handles: list[RouteHandle],
        requests: int,
        timeout: float | None,
        *,
        coalesced: bool = False,
        pipelined: bool = False,
    ) -> BatchResult:
        """Run validated groups (uint64 offset and length arrays) as one job each, in order
        (``pipelined``: WRITEs to one TCP peer, handed to the transport at once).

        Every route and region is held before the first byte moves (a route closed meanwhile
        fails the call with nothing copied) and each is let go as soon as its job ended, as a
        Batch does (in one pass, ``execute_many``: all at the end); the first failure ends
        the call (it fails as a whole anyway).
        """
        held: list[tuple[MemoryRegion, RouteHandle]] = []
        try:
            for (local, remote, *_), h in zip(groups, handles):
                if not h.acquire():
                    raise remote.gone_error()
                try:
                    local.acquire()
                except BaseException:
                    h.release()
                    raise
                held.append((local, h))
            t0 = time.monotonic()
            deadline = t0 + (self.config.transfer_timeout if timeout is None else timeout)
            jobs = [
                TransferJob(
                    op,
                    local,
                    remote.desc,
                    h.route,
                    lo,
                    ro,
                    ln,
                    nb,
                    deadline,
                    remote.peer.liveness,
                    coalesced=coalesced,
                )
                for (local, remote, lo, ro, ln, nb), h in zip(groups, handles)
            ]
            nbytes = sum(j.nbytes for j in jobs)
            served: list[TransportKind] = []
            # One copy slot for the whole call, not one per (small) job: fastcopy.bulk_slot.
            cpu = all(h.transport.cpu_copy for h in handles)
            with bulk_slot(nbytes if cpu else 0):
                if pipelined:
                    h = handles[0]
                    try:
                        h.transport.execute_writes(jobs)
                    except TransferError:
                        raise
                    except Exception as exc:
                        raise _failed(h, f"writing to {h.route.address}", exc) from exc
                    served.append(h.transport.kind)
                elif len(jobs) > 1 and _one_pass(handles):
                    # One job per pair of registered buffers, a few pages each (a PD request:
                    # 64 pairs): one fence entry per region and one copy loop for the call,
                    # not a job's set-up each (ShmTransport.execute_many).
                    h = handles[0]
                    try:
                        h.transport.execute_many(jobs)
                    except TransferError:
                        raise
                    except Exception as exc:
                        raise _failed(h, f"on segment {jobs[0].remote.name!r}", exc) from exc
                    served.append(h.transport.kind)
                else:
                    for i, (job, h) in enumerate(zip(jobs, handles)):
                        try:
                            job.check()
                            h.transport.execute(job)
                        except TransferError:
                            raise
                        except Exception as exc:
                            raise _failed(h, f"on segment {job.remote.name!r}", exc) from exc
                        finally:
                            held[i] = None  # type: ignore[call-overload]
                            job.local.release()
                            h.release()
                        if h.transport.kind not in served:
                            served.append(h.transport.kind)
        finally:
            for item in held:
                if item is not None:
                    item[0].release()
                    item[1].release()
        self._note_batch()
        return BatchResult(
            state=BatchState.DONE,
            requests=requests,
            nbytes=nbytes,
            failed=0,
            transports=sorted(served, key=lambda k: k.value) if len(served) > 1 else served,
            elapsed_s=time.monotonic() - t0,
        )

    def _route(self, local: MemoryRegion, remote: RemoteSegment) -> RouteHandle:
        return remote.route_for(local, self._open_route)

    def _open_route(self, local: MemoryRegion, remote: RemoteSegment) -> RouteHandle:
        return _select.open_route(
            self._transports, local, remote, host_id=self.host_id, unavailable=self.transport_status
        )

    def _note_batch(self) -> None:
        with self._stats_lock:
            self._stats["batches"] += 1

    # --- standalone tensors -----------------------------------------------------------------
    def expose_tensor(self, name: str, tensor: Any) -> SegmentDescriptor:
        """Register ``tensor`` (torch or numpy, contiguous) and publish it as ``name``.

        Peers then call :meth:`read_tensor` / :meth:`write_tensor` with our address and the
        name. Unexpose with ``unpublish(name)`` (or :meth:`unregister` of the region).
        """
        dtype, shape, _ = _tensor_meta(tensor)
        region = self.register(tensor)
        try:
            return self.publish(
                region, name, meta={"dtype": dtype, "shape": ",".join(map(str, shape))}
            )
        except BaseException:
            self.unregister(region)
            raise

    def _tensor_io(
        self, op: Op, address: str, name: str, tensor: Any, timeout: float | None
    ) -> BatchResult:
        dtype, shape, nbytes = _tensor_meta(tensor)
        seg = self.open_segment(address, name)
        meta = seg.desc.meta
        want = ",".join(map(str, shape))
        if seg.size != nbytes or (
            "dtype" in meta and (meta["dtype"] != dtype or meta.get("shape") != want)
        ):
            raise TensorMismatch(
                f"tensor {name!r} of {address} "
                f"is {meta.get('dtype', '?')}[{meta.get('shape', '?')}] "
                f"({seg.size} bytes); ours is {dtype}[{want}] ({nbytes} bytes)"
            )
        ptr, size, _, _, _ = describe_object(tensor)
        temp = None
        try:
            region, off = self._regions.find(ptr, size)
        except NotRegistered:
            temp = region = self.register(tensor)
            off = 0
        try:
            return self.transfer(op, region, [off], seg, [0], [nbytes], timeout=timeout)
        finally:
            if temp is not None:
                self.unregister(temp)

    def read_tensor(
        self, address: str, name: str, into: Any, *, timeout: float | None = None
    ) -> BatchResult:
        """Copy the tensor ``name`` exposed by the engine at ``address`` into ``into``.

        ``into`` must match its dtype and shape. Register ``into`` beforehand to skip a
        temporary registration per call.
        """
        return self._tensor_io(Op.READ, address, name, into, timeout)

    def write_tensor(
        self, address: str, name: str, src: Any, *, timeout: float | None = None
    ) -> BatchResult:
        """Copy ``src`` into the tensor ``name`` exposed by the engine at ``address``."""
        return self._tensor_io(Op.WRITE, address, name, src, timeout)

    # --- transport calls and monitor callbacks ----------------------------------------------
    def _transport_call(
        self, address: str, kind: TransportKind, payload: bytes, timeout: float | None
    ) -> bytes:
        return self.peer(address).call(TransportKind(kind).value, payload, timeout)

    def _handle_call(self, kind: str, payload: bytes) -> bytes:
        if kind == TransportKind.DISK.value:  # sync/checksum of our disk segments (disk.py)
            return _disk.handle_call(payload, self.config)
        try:
            t = self.transport(kind)
        except ValueError:
            t = None
        if t is None:
            raise TransportUnavailable(f"transport {kind[:64]!r} is not enabled on {self.node_id}")
        if type(t).handle_call is Transport.handle_call:
            raise TransportUnavailable(f"transport {kind!r} takes no peer calls")
        return t.handle_call(payload)

    def _on_segment_removed(self, peer: PeerClient, name: str, seg_id: int) -> None:
        with self._lock:
            self._removed.add(seg_id)
            if len(self._removed) > 100_000:  # bounded memory; old ids no longer matter
                self._removed.clear()
            rs = self._remote.get((peer.engine_id, name))
            if rs is None or rs.desc.seg_id != seg_id:
                return
            del self._remote[(peer.engine_id, name)]
            self._remote_gen += 1
        rs.stale_reason = "removed by its owner"
        rs.close_routes()

    def _on_peer_dead(self, peer: PeerClient, reason: str) -> None:
        if peer.liveness.dead_reason is None:
            peer.liveness.dead_reason = reason
        if not self._closed:
            log.info("peer %s (%s) is gone: %s", peer.address, peer.node_id, reason)
        with self._lock:
            if self._peers.get(peer.address) is peer:
                del self._peers[peer.address]
            gone = [(k, s) for k, s in self._remote.items() if s.peer is peer]
            for k, _ in gone:
                del self._remote[k]
            self._remote_gen += 1
        for _, s in gone:
            s.stale_reason = s.stale_reason or f"owner is dead: {reason}"
            s.close_routes()
        for t in self._transports:
            try:
                t.peer_lost(peer.engine_id)
            except Exception:
                log.exception("transport %s failed in peer_lost", t.kind.value)
        peer.close()

    # --- introspection / shutdown ---------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """A summary for humans and tools (``kvmesh info``)."""
        return {
            "node_id": self.node_id,
            "engine_id": self.engine_id,
            "host_id": self.host_id,
            "address": self.address,
            "pid": self.pid,
            "transports": {
                k: ("enabled" if v is None else v) for k, v in self.transport_status.items()
            },
            "regions": len(self._regions.all()),
            "disk_segments": [repr(d) for d in self._disks.values()],
            "segments": [d.name for d in self._table.list()],
            "peers": sorted(self._peers),
            "batches": self._stats["batches"],
        }

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop every thread, drop peers and routes, free what the engine allocated."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.close()
        with self._lock:
            peers = list(self._peers.values())
            remote = list(self._remote.values())
            self._peers.clear()
            self._remote.clear()
            self._remote_gen += 1
        for p in peers:
            p.liveness.dead_reason = p.liveness.dead_reason or "local engine closed"
            p.close()
        if self._monitor is not None:
            self._monitor.close()
        self._executor.close()
        for s in remote:
            s.stale_reason = s.stale_reason or "local engine closed"
            s.close_routes()
        for region in [*self._regions.all(), *self._disks.values()]:
            try:
                self.unregister(region, timeout=2.0)
            except TransferTimeout:
                # A transfer still runs on it: leak the memory rather than free it under the copy.
                log.warning("closing with %r still in use; not freeing it", region)
                self._owned_buffers.pop(region.region_id, None)
            except TransferError:
                pass
        for t in reversed(self._transports):
            try:
                t.close()
            except Exception:
                log.exception("transport %s failed to close", t.kind.value)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kinds = [k.value for k in self.transports]
        return f"TransferEngine({self.node_id!r} at {self.address}, transports={kinds})"


# --- the process-wide shared engine -----------------------------------------------------------
_shared: TransferEngine | None = None
_shared_args: list[Any] = [None, None, None]  # what created it: (node_id, listen, config)
_shared_lock = threading.Lock()


def init_engine(
    node_id: str | None = None,
    listen: str | None = None,
    config: EngineConfig | None = None,
) -> TransferEngine:
    """Create the process-wide engine, or return it if it exists (arguments then must agree)."""
    global _shared
    with _shared_lock:
        if _shared is not None and not _shared.closed:
            if node_id is not None and node_id != _shared.node_id:
                raise InvalidArgument(
                    f"the shared engine already runs as node {_shared.node_id!r}, not {node_id!r}"
                )
            if (listen is not None and listen != _shared_args[1]) or (
                config is not None and config != _shared_args[2]
            ):
                raise InvalidArgument(
                    "the shared engine already runs with another listen address or configuration"
                )
            return _shared
        _shared = TransferEngine(node_id, listen, config)
        _shared_args[:] = [node_id, listen, config]
        return _shared


def get_engine() -> TransferEngine:
    """The process-wide engine (created from ``KVMESH_*`` environment variables if needed)."""
    eng = _shared
    if eng is not None and not eng.closed:
        return eng
    return init_engine()


def shutdown_engine() -> None:
    """Close the process-wide engine, if any."""
    global _shared
    with _shared_lock:
        eng, _shared = _shared, None
    if eng is not None:
        eng.close()


atexit.register(shutdown_engine)


class GroupedResult(NamedTuple):
    """What :meth:`TransferEngine.transfer_grouped` moved: per request whether it moved
    (``ok``, in the caller's order) and the results of the batches that ran."""

    ok: np.ndarray
    results: list[BatchResult]
    one_by_one: bool = False  # the batch was refused: its groups ran (and failed) alone


def pair_groups(reg: np.ndarray, seg: np.ndarray, nseg: int) -> tuple[np.ndarray, list[int]]:
    """Requests grouped per (region ``reg[r]``, segment ``seg[r]``) pair: the stable order
    that puts each pair's requests together, and the cuts between the groups in that order
    (``[0, ..., len]``). One sort for the whole call, not one mask per group."""
    key = reg * nseg + seg
    if len(key) < 2 or int(key.min()) == int(key.max()):
        return np.arange(len(key)), [0, len(key)]
    order = np.argsort(key, kind="stable")
    key = key[order]
    return order, [0, *(np.flatnonzero(key[1:] != key[:-1]) + 1).tolist(), len(key)]
