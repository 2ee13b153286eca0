"""NIXL transport: one-sided READ/WRITE through a NIXL agent with a UCX backend.

Serves (docs/transfer.md, "Transport selection") host memory of another process on this host
that is not in a shared segment (UCX picks ``cma``: process_vm_readv/writev), segments on other
hosts (UCX: RDMA where present, else TCP), and GPU memory when CUDA is present (UCX cuda
transports).

Everything is lazy, so an engine that never needs NIXL pays nothing (no import, no agent, no
progress thread):

* ``describe`` only names the agent the owner *would* use (``nixl_agent`` in the descriptor);
* ``open`` asks the owner, over the engine's authenticated control channel, for the NIXL
  metadata of that one region (``MetaReq``; the owner creates its agent and registers the
  region on the first request) and loads it: 423 bytes, connection info included;
* a local region is registered with our agent the first time a job uses it.

Over TCP-only UCX a NIXL READ is a software-emulated GET (0.42-0.54 GB/s, about half of an
owner push; docs/nixl.md, "READ over TCP-only UCX"). When the GET would be emulated
(``UCX_TLS``/``ucx_tls`` is TCP only, or the owner is on another host and this host has no RDMA
device), a READ is served as a push by the owner instead; ``read_mode``
(``KVMESH_NIXL=read_mode=...``) picks how:

* ``socket`` (default when emulated): the owner pushes the pages over the engine's plain TCP
  data path, received with ``recv_into`` straight into local memory;
* ``push``: the owner WRITEs them with its own NIXL agent (``PullReq`` carries our partial
  metadata);
* ``nixl``: always a NIXL READ (what UCX does by itself).

Host memory on *another host* goes to the plain TCP transport instead when this host has no
RDMA device (``network=auto``, the default): UCX would only have TCP there, and the engine's
own socket path measured faster. ``KVMESH_NIXL=network=nixl`` keeps NIXL for it.

docs/nixl.md has the measurements behind the defaults.

Memory lifetime: on the same host a job runs inside the owner's fence
(:mod:`kvmesh.transfer.fence`) and long jobs are posted in chunks of ``NIXL_CHUNK_BYTES`` with
a check between them, because a cma copy cannot be stopped once posted and the owner cannot
revoke ``process_vm_writev`` access: it waits for the fence instead. Between hosts the owner
deregisters the memory from NIXL (RDMA revokes the key); see docs/transfer.md.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
from typing import Any, Literal

import msgspec
import numpy as np

from .. import fence
from .. import nixl as na
from ..errors import (
    InvalidArgument,
    NotRegistered,
    ProtocolError,
    SegmentNotFound,
    TransferError,
    TransportUnavailable,
)
from ..memory import MemoryRegion
from ..protocol import split_host_port
from ..types import MemoryKind, Op, SegmentDescriptor, TransportKind
from . import tcp
from .base import CHUNK_BYTES, TransferJob, Transport, TransportContext, chunks

log = logging.getLogger("kvmesh.transfer")

ReadMode = Literal["auto", "nixl", "push", "socket"]

# UCX transports that can do a real one-sided GET (no software emulation).
_TCP_ONLY = {"tcp", "self", "sockcm", "tcp_sockcm"}

# A posted NIXL transfer cannot be stopped, so long jobs are posted in chunks with a check
# between them. Each chunk pays its own descriptor work (splitting, make_xfer, release:
# 20 us measured for 1 MiB pages) against ~10-20 ms of cma copying per 32 MiB, i.e. ~0.1 %;
# the owner's unregister waits at most one chunk for a peer that is copying.
NIXL_CHUNK_BYTES = 4 * CHUNK_BYTES


# --- transport-private messages (engine control channel, msgpack) ---------------------------


class MetaReq(msgspec.Struct, tag="nixl_meta"):
    """Ask a segment owner for the NIXL metadata of the region behind segment ``name``."""

    name: str
    region_id: int
    base: int
    size: int


class MetaResp(msgspec.Struct, tag="nixl_meta_resp"):
    agent: str
    metadata: bytes


class PullReq(msgspec.Struct, tag="nixl_pull"):
    """Ask a segment owner to WRITE ranges of its segment into our registered region."""

    name: str
    region_id: int
    base: int
    size: int
    agent: str  # our NIXL agent name
    metadata: bytes  # our partial metadata: connection info + the destination region
    dest_addr: int
    dest_size: int
    dest_kind: str
    dest_device: int
    dest_offsets: bytes  # little-endian uint64
    src_offsets: bytes
    lengths: bytes
    timeout: float


class PullResp(msgspec.Struct, tag="nixl_pull_resp"):
    nbytes: int


_Request = MetaReq | PullReq
_dec_req = msgspec.msgpack.Decoder(_Request)
_dec_meta = msgspec.msgpack.Decoder(MetaResp)
_dec_pull = msgspec.msgpack.Decoder(PullResp)
_enc = msgspec.msgpack.Encoder()


def _u64(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<u8")


def _is_loopback(listen: str) -> bool:
    try:
        host, _ = split_host_port(listen)
    except Exception:
        return False
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _devices_chosen(opts: na.NixlOptions) -> bool:
    """Whether the user picked UCX's network devices (option, agent config or environment)."""
    if opts.ucx_devices is not None or "UCX_NET_DEVICES" in os.environ:
        return True
    return any(
        kv.split("=", 1)[0].strip().upper() == "NET_DEVICES" for kv in opts.engine_config.split(",")
    )


def get_is_emulated(tls: str | None, same_host: bool, rdma: bool) -> bool:
    """Whether UCX would serve a GET by software emulation (TCP-only lanes)."""
    if tls:
        names = {t.strip().lower() for t in tls.split(",") if t.strip()}
        if names and not any(n.startswith("^") for n in names) and names <= _TCP_ONLY:
            return True
    return not same_host and not rdma


class _Route:
    __slots__ = ("peer", "remote", "control", "engine_id", "read_mode", "desc", "fence")

    def __init__(
        self,
        peer: str,
        remote: na.RemoteRegion,
        desc: SegmentDescriptor,
        read_mode: str,
        fc: fence.FenceClient | None,
    ) -> None:
        self.peer = peer
        self.remote = remote
        self.control = desc.control
        self.engine_id = desc.engine_id
        self.read_mode = read_mode
        self.desc = desc
        self.fence = fc  # the owner's fence when it runs on this host


def _nixl_kind(kind: MemoryKind) -> na.Kind:
    return "VRAM" if kind is MemoryKind.VRAM else "DRAM"


def _cuda_ok() -> bool:
    try:
        from .. import cuda

        return cuda.available()
    except Exception:
        return False


class NixlTransport(Transport):
    """Engine transport over :class:`~kvmesh.transfer.nixl.NixlAgent`."""

    kind = TransportKind.NIXL
    # cma copies run inside the posting call: small jobs run in the submitting thread.
    inline_ok = True
    # Cutting a job into parts for several threads does not pay for NIXL: one agent posts
    # them one after the other, and the extra handles cost 7-25 % (2-vCPU box, 6 interleaved
    # rounds: READ 256 KiB x 128 5.03 GB/s whole vs 4.67 split at 16 MiB, WRITE 5.27 vs
    # 4.08; 1 MiB x 64: READ 5.49 vs 4.72, WRITE 5.63 vs 4.83).
    split_ok = False

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        raw = dict(ctx.config.nixl)
        read_mode = raw.pop("read_mode", "auto").strip().lower()
        if read_mode not in ("auto", "nixl", "push", "socket"):
            raise InvalidArgument(
                f"NIXL read_mode must be auto|nixl|push|socket, not {read_mode!r}"
            )
        self.read_mode: ReadMode = read_mode  # type: ignore[assignment]
        network = raw.pop("network", "auto").strip().lower()
        if network not in ("auto", "nixl", "tcp"):
            raise InvalidArgument(f"NIXL network must be auto|nixl|tcp, not {network!r}")
        self.network = network
        opts = na.NixlOptions.from_dict(raw)
        if _is_loopback(ctx.config.listen) and not _devices_chosen(opts):
            # A loopback-only engine: keep UCX's TCP lanes and its listening socket (which
            # kvmesh's token does not cover) off the other interfaces too.
            opts = msgspec.structs.replace(opts, ucx_devices="lo")
        self.options = opts
        self.agent_name = f"kvmesh-{ctx.node_id}-{ctx.engine_id}"
        self._agent: na.NixlAgent | None = None
        self._lock = threading.Lock()
        self._peers: dict[str, str] = {}  # engine id -> NIXL agent name
        self._rdma = na.has_rdma_devices()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        # Cheap: finds the package without importing it (the import and UCX load wait for
        # the first real use).
        return na.installed_reason()

    # --- agent and local regions ------------------------------------------------------------
    @property
    def agent(self) -> na.NixlAgent:
        """This engine's NIXL agent (created on first use)."""
        ag = self._agent
        if ag is not None:
            return ag
        with self._lock:
            if self._agent is None:
                self._agent = na.NixlAgent(self.agent_name, self.options)
                log.info(
                    "NIXL agent %s up (%s, progress %s)",
                    self.agent_name,
                    self._agent.nixl_module,
                    self._agent.progress_mode,
                )
            return self._agent

    @property
    def started(self) -> bool:
        return self._agent is not None

    def _nixl_region(self, region: MemoryRegion) -> na.NixlRegion:
        nr = region.transport_data.get("nixl")
        if nr is not None and nr.live:
            return nr
        with self._lock:
            nr = region.transport_data.get("nixl")
            if nr is not None and nr.live:
                return nr
            if region.closed:
                raise NotRegistered(f"{region!r} was unregistered")
        agent = self.agent
        with self._lock:
            nr = region.transport_data.get("nixl")
            if nr is None or not nr.live:
                device = region.device if region.device >= 0 else 0
                nr = agent.register(region.ptr, region.size, _nixl_kind(region.kind), device)
                region.transport_data["nixl"] = nr
            return nr

    def read_mode_for(self, remote: SegmentDescriptor) -> str:
        """How READs from ``remote`` are served: ``nixl``, ``socket`` or ``push`` (see above)."""
        return self._read_mode(remote)

    def _read_mode(self, remote: SegmentDescriptor) -> str:
        if self.read_mode != "auto":
            return self.read_mode
        tls = self.options.ucx_tls or os.environ.get("UCX_TLS")
        if get_is_emulated(tls, remote.host_id == self.ctx.host_id, self._rdma):
            return "socket" if remote.kind.is_host else "push"
        return "nixl"

    # --- Transport interface ---------------------------------------------------------------
    def on_unregister(self, region: MemoryRegion) -> None:
        nr = region.transport_data.pop("nixl", None)
        region.transport_data.pop("nixl_md", None)
        if nr is not None and self._agent is not None:
            self._agent.deregister(nr)

    def describe(self, region: MemoryRegion) -> dict[str, Any]:
        if region.kind is MemoryKind.VRAM and not _cuda_ok():
            return {}
        return {"nixl_agent": self.agent_name}

    def can_serve(self, local: MemoryRegion, remote: SegmentDescriptor) -> bool:
        if remote.nixl_agent is None:
            return False
        if remote.pid == self.ctx.pid and remote.host_id == self.ctx.host_id:
            return False  # same process: the local transport
        host_only = local.is_host and remote.kind.is_host
        if not host_only and not _cuda_ok():
            return False
        # Host memory on another host goes to the plain TCP transport where that is faster.
        return not (host_only and remote.host_id != self.ctx.host_id and self._cede_network())

    def _cede_network(self) -> bool:
        """Whether host-to-host traffic to other hosts goes to the plain TCP transport.

        Without an RDMA device UCX can only use TCP between hosts, and there the engine's own
        socket path measured faster in both directions (1 MiB x 64 WRITE 0.84 vs 0.36-0.53 x a
        raw socket stream; 16 KiB WRITE 1.1 vs 0.2 GB/s; docs/nixl.md). ``network=nixl`` keeps
        NIXL anyway, ``network=tcp`` cedes even with RDMA present.
        """
        if self.network == "auto":
            return not self._rdma
        return self.network == "tcp"

    def open(self, remote: SegmentDescriptor) -> Any:
        req = MetaReq(remote.name, remote.region_id, remote.base, remote.size)
        starter = None
        if self._agent is None:
            # The first agent of a process takes ~0.45 s (UCX loads and probes); so may the
            # owner's, which it creates to answer us: let both happen at the same time. A
            # failure shows again (and is reported) when self.agent is read below.
            def start() -> None:
                try:
                    _ = self.agent  # the property creates the agent
                except Exception:
                    pass

            starter = threading.Thread(target=start, name="kvmesh-nixl-start", daemon=True)
            starter.start()
        try:
            reply = self.ctx.call(remote.control, self.kind, _enc.encode(req), None)
        finally:
            if starter is not None:
                starter.join()
        try:
            agent = self.agent
        except TransferError as exc:
            raise TransportUnavailable(f"NIXL agent: {exc}") from None
        try:
            resp = _dec_meta.decode(reply)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"bad NIXL metadata reply from {remote.control}: {exc}") from None
        if resp.agent != remote.nixl_agent:
            raise TransportUnavailable(
                f"segment {remote.name!r} names NIXL agent {remote.nixl_agent!r} but its owner "
                f"runs {resp.agent!r}"
            )
        peer = agent.add_remote(resp.metadata)
        with self._lock:
            self._peers[remote.engine_id] = peer
        rr = na.RemoteRegion(
            remote.base,
            remote.size,
            _nixl_kind(remote.kind),
            remote.device if remote.device >= 0 else 0,
        )
        fc = None
        if remote.host_id == self.ctx.host_id:
            # Same host: UCX copies with cma, which only the owner's fence makes safe against
            # unregister. No fence (or one we cannot open): let the next transport serve it.
            if remote.fence is None:
                raise TransportUnavailable(f"segment {remote.name!r} has no fence file")
            try:
                fc = fence.attach(remote.fence)
            except (OSError, InvalidArgument) as exc:
                raise TransportUnavailable(
                    f"cannot open the fence of segment {remote.name!r}: {exc}"
                ) from None
        return _Route(peer, rr, remote, self._read_mode(remote), fc)

    def execute(self, job: TransferJob) -> None:
        route: _Route = job.route
        if job.op is Op.READ and route.read_mode != "nixl":
            # The owner moves these bytes itself, holding its region (unregister waits).
            if route.read_mode == "socket" and job.local.is_host:
                self._socket_read(job)
            else:
                self._pull(job, route)
            return
        fc = route.fence
        if fc is None:
            self._post_chunks(job, route, None)
            return
        rid = job.remote.region_id
        fc.enter(rid, job.remote.name)
        try:
            self._post_chunks(job, route, fc)
        finally:
            fc.leave(rid)

    def _post_chunks(self, job: TransferJob, route: _Route, fc: fence.FenceClient | None) -> None:
        agent = self.agent
        local = self._nixl_region(job.local)
        op = "READ" if job.op is Op.READ else "WRITE"
        if job.nbytes <= NIXL_CHUNK_BYTES:
            parts = [(job.local_offsets, job.remote_offsets, job.lengths)]
        else:
            parts = chunks(job.local_offsets, job.remote_offsets, job.lengths, NIXL_CHUNK_BYTES)
        try:
            for i, (lo, ro, ln) in enumerate(parts):
                if i:
                    job.check()
                    if fc is not None:
                        fc.check(job.remote.region_id, job.remote.name)
                xfer = agent.make_xfer(
                    op, local, lo, route.peer, route.remote, ro, ln, trusted=True
                )
                try:
                    if not xfer.post():
                        xfer.wait(job.remaining(), check=job.check)
                finally:
                    xfer.release()
        except NotRegistered:
            job.check()  # a peer that died meanwhile (NIXL forgot its agent) is the real cause
            raise

    def _socket_read(self, job: TransferJob) -> None:
        lo, ro, ln = job.coalesced()
        mv = memoryview(job.local.array())
        views = [mv[o : o + n] for o, n in zip(lo.tolist(), ln.tolist())]
        peer = self.ctx.peer(job.remote.control)
        tcp.read_views(peer, job.remote, ro, ln, views, job.nbytes, job.remaining())

    def _pull(self, job: TransferJob, route: _Route) -> None:
        agent = self.agent
        local = self._nixl_region(job.local)
        md = job.local.transport_data.get("nixl_md")
        if md is None:
            md = job.local.transport_data["nixl_md"] = agent.partial_metadata([local], True)
        lo, ro, ln = job.local_offsets, job.remote_offsets, job.lengths
        d = job.remote
        timeout = job.remaining()
        req = PullReq(
            d.name,
            d.region_id,
            d.base,
            d.size,
            agent.name,
            md,
            local.addr,
            local.size,
            local.kind,
            local.device,
            lo.astype("<u8", copy=False).tobytes(),
            ro.astype("<u8", copy=False).tobytes(),
            ln.astype("<u8", copy=False).tobytes(),
            timeout,
        )
        reply = self.ctx.call(route.control, self.kind, _enc.encode(req), timeout + 1.0)
        resp = _dec_pull.decode(reply)
        if resp.nbytes != job.nbytes:
            raise ProtocolError(f"owner pushed {resp.nbytes} bytes for a {job.nbytes} byte READ")

    # --- owner side ------------------------------------------------------------------------
    def _owned(self, name: str, region_id: int, base: int, size: int) -> MemoryRegion:
        region = self.ctx.find_region(region_id)
        if (
            region is None
            or region.closed
            or region.name != name
            or region.ptr != base
            or region.size != size
        ):
            raise SegmentNotFound(f"segment {name!r} is not published here (any more)")
        return region

    def handle_call(self, payload: bytes) -> bytes:
        try:
            req = _dec_req.decode(payload)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"bad NIXL transport request: {exc}") from None
        try:
            agent = self.agent
        except TransferError as exc:
            raise TransportUnavailable(f"the owner's NIXL agent cannot start: {exc}") from None
        region = self._owned(req.name, req.region_id, req.base, req.size)
        if isinstance(req, MetaReq):
            nr = self._nixl_region(region)
            return _enc.encode(MetaResp(agent.name, agent.partial_metadata([nr], True)))
        # PullReq: WRITE our segment's ranges into the requester's region.
        region.acquire()
        try:
            nr = self._nixl_region(region)
            peer = agent.add_remote(req.metadata)
            if peer != req.agent:
                raise ProtocolError(f"pull metadata names agent {peer!r}, not {req.agent!r}")
            dest = na.RemoteRegion(
                req.dest_addr,
                req.dest_size,
                req.dest_kind,  # type: ignore[arg-type]
                req.dest_device,
            )
            xfer = agent.transfer(
                "WRITE",
                nr,
                _u64(req.src_offsets),
                peer,
                dest,
                _u64(req.dest_offsets),
                _u64(req.lengths),
                timeout=max(0.001, req.timeout),
            )
            return _enc.encode(PullResp(xfer.nbytes))
        finally:
            region.release()

    # --- lifecycle --------------------------------------------------------------------------
    def close_route(self, route: Any) -> None:
        # The peer agent stays loaded: other segments of the same peer may still use it; it
        # goes in peer_lost() or close().
        if route.fence is not None:
            fence.detach(route.fence)

    def peer_lost(self, engine_id: str) -> None:
        with self._lock:
            peer = self._peers.pop(engine_id, None)
        if peer is not None and self._agent is not None:
            self._agent.remove_remote(peer)

    def close(self) -> None:
        with self._lock:
            agent, self._agent = self._agent, None
            self._peers.clear()
        if agent is not None:
            agent.close()
