"""Wire and configuration types of the transfer engine (msgspec Structs and enums).

Nothing here does I/O. :class:`SegmentDescriptor` is what a peer learns about a segment;
:class:`EngineConfig` is every knob of an engine, loadable from ``KVMESH_*`` environment
variables so that processes started by other software (SGLang workers) can be configured
without code changes.
"""

from __future__ import annotations

import enum
import os
from typing import Any

import msgspec


class MemoryKind(str, enum.Enum):
    """Where a region's bytes live."""

    DRAM = "dram"  # private host memory of the owner process
    SHM = "shm"  # host memory in a named shared-memory file peers on the same host can map
    VRAM = "vram"  # GPU memory (``device`` is the CUDA device index)
    DISK = "disk"  # a file on a local filesystem of the owner (a disk segment: disk.py)

    @property
    def is_host(self) -> bool:
        # Disk segments count as host-side: the owner moves their bytes through host memory
        # (the TCP path serves them like host memory; transfer/disk.py).
        return self is not MemoryKind.VRAM


class TransportKind(str, enum.Enum):
    """The ways bytes can move. The engine picks one per (local memory, remote segment)."""

    LOCAL = "local"  # same process: memmove
    SHM = "shm"  # same host, remote segment in shared memory: map it and copy directly
    NIXL = "nixl"  # NIXL agent over UCX (cma on one host, RDMA or TCP across hosts)
    TCP = "tcp"  # plain sockets through the owner's control server (push both ways)
    CUDA_IPC = "cuda_ipc"  # same host GPU memory via CUDA IPC handles
    NVLINK = "nvlink"  # CUDA IPC between peer-capable GPUs (NVLink / P2P)
    DISK = "disk"  # a disk segment of this process: pread/pwrite into local memory


class Op(str, enum.Enum):
    """Direction of a request, seen from the local side."""

    READ = "read"  # remote segment -> local memory
    WRITE = "write"  # local memory -> remote segment


class RequestStatus(enum.IntEnum):
    """Per-request status, as stored in a batch's ``numpy.int8`` status array."""

    PENDING = 0
    DONE = 1
    FAILED = 2
    CANCELLED = 3


class BatchState(str, enum.Enum):
    """Lifecycle of a batch."""

    OPEN = "open"  # accepting requests
    SUBMITTED = "submitted"  # in flight
    DONE = "done"  # every request completed
    FAILED = "failed"  # every request finished, at least one failed
    FREED = "freed"


class SegmentDescriptor(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a peer needs to know about a published segment.

    ``seg_id`` changes every time a name is (re)published: requests carry it, so a peer that
    cached an old descriptor is refused instead of writing into a replacement segment.
    Transport-specific fields are filled in by the transports' ``describe`` hooks.
    """

    name: str
    seg_id: int
    node_id: str
    host_id: str
    engine_id: str
    pid: int
    region_id: int
    kind: MemoryKind
    device: int = -1
    base: int
    size: int
    control: str  # "host:port" of the owner's control server
    shm_name: str | None = None  # file name under /dev/shm when kind is SHM
    shm_offset: int = 0  # where the segment starts inside that file
    shm_size: int = 0  # size of the whole file (peers map it once for all its segments)
    fence: str | None = None  # the owner's fence file under /dev/shm (kvmesh/transfer/fence.py)
    cuda_ipc: bytes | None = None  # cudaIpcMemHandle_t of the allocation holding the segment
    cuda_ipc_offset: int = 0  # segment start minus the allocation base
    nixl_agent: str | None = None
    nixl_meta: bytes | None = None
    meta: dict[str, str] = {}  # user metadata (the tensor API stores dtype and shape here)
    extra: dict[str, bytes] = {}  # room for transports that need more


def _env_list(value: str) -> list[str]:
    return [v.strip().lower() for v in value.split(",") if v.strip()]


class EngineConfig(msgspec.Struct, kw_only=True):
    """Configuration of a :class:`~kvmesh.transfer.engine.TransferEngine`.

    Environment variables (``EngineConfig.from_env``) use the field name upper-cased with a
    ``KVMESH_`` prefix; two names are shorter: ``KVMESH_TRANSPORT`` forces one transport and
    ``KVMESH_TRANSPORTS_DISABLE`` is a comma-separated deny list.
    """

    node_id: str | None = None  # default: "<hostname>-<pid>-<random>"
    listen: str = "127.0.0.1:0"  # control server address; port 0 picks a free port
    advertise: str | None = None  # address given to peers (default: the bound address)
    host_id: str | None = None  # override locality detection (tests force "other host")
    token: str | None = None  # the cluster secret; peers must prove they hold a key of it
    token_file: str | None = None  # read the shared secret from this file instead
    # Or a credential derived from the secret (kvmesh keys; docs/net.md, "Identity"): the
    # engine authenticates as a client with its client key.
    credential: str | None = None
    credential_file: str | None = None
    allow_insecure: bool = False  # allow listening on a non-loopback address without a token
    transport: TransportKind | None = None  # force one transport for every remote segment
    transports_allow: list[TransportKind] | None = None  # None: every available transport
    transports_disable: list[TransportKind] = []
    connect_timeout: float = 5.0  # seconds to connect and authenticate to a peer
    control_timeout: float = 10.0  # seconds for a control call (descriptor lookups, ping)
    transfer_timeout: float = 60.0  # default deadline of a submitted batch
    workers: int = 4  # transfer worker threads (CPU copies and socket streams)
    inline_bytes: int = 1 << 20  # local/shm jobs up to this size run in the submitting thread
    split_bytes: int = 16 << 20  # larger jobs are cut into parts that run in parallel
    tcp_max_idle: int = 8  # idle data connections kept per peer
    # Limits of the control server (what one peer may cost this engine; docs/transfer.md).
    max_connections: int = 1024  # served connections in total; more are closed at once
    max_unauthenticated: int = 64  # connections still in their handshake
    max_unauthenticated_per_source: int = 32  # of those, from one address (IPv6: one /64)
    request_timeout: float = 60.0  # one request: its frame, payload and reply
    idle_timeout: float = 300.0  # a data connection with no request for this long is closed
    max_request_pieces: int = 1 << 20  # (offset, length) pieces in one WRITE/READ request
    max_request_bytes: int = 1 << 30  # payload bytes of one WRITE/READ request
    tcp_keepalive: bool = True  # detect half-open peers on real networks
    shm_populate: bool = True  # pre-fault shared mappings (first touch is 5x slower)
    shm_sweep: bool = True  # unlink /dev/shm files left by dead kvmesh processes on this host
    nixl: dict[str, str] = {}  # options passed through to the NIXL transport

    def __post_init__(self) -> None:
        # Plain constructors are not validated by msgspec: accept strings for the enums here so
        # EngineConfig(transport="tcp") means what it says.
        from .errors import InvalidArgument

        try:
            if self.transport is not None and not isinstance(self.transport, TransportKind):
                self.transport = TransportKind(str(self.transport).lower())
            if self.transports_allow is not None:
                self.transports_allow = [
                    TransportKind(str(getattr(k, "value", k)).lower())
                    for k in self.transports_allow
                ]
            self.transports_disable = [
                TransportKind(str(getattr(k, "value", k)).lower()) for k in self.transports_disable
            ]
        except ValueError as exc:
            known = ", ".join(k.value for k in TransportKind)
            raise InvalidArgument(
                f"unknown transport in engine configuration ({exc}); known: {known}"
            ) from None
        if self.workers < 1:
            raise InvalidArgument(f"workers must be >= 1, got {self.workers}")
        for name in (
            "max_connections",
            "max_unauthenticated",
            "max_unauthenticated_per_source",
            "max_request_pieces",
            "max_request_bytes",
        ):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout", "idle_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> EngineConfig:
        """Build a config from ``KVMESH_*`` variables; keyword overrides win over the env."""
        env = os.environ if environ is None else environ
        raw: dict[str, Any] = {}
        for field in cls.__struct_fields__:
            key = "KVMESH_" + field.upper()
            if field == "transports_disable":
                key = "KVMESH_TRANSPORTS_DISABLE"
            if key in env and env[key] != "":
                raw[field] = env[key]
        if "transports_allow" in raw:
            raw["transports_allow"] = _env_list(raw["transports_allow"])
        if "transports_disable" in raw:
            raw["transports_disable"] = _env_list(raw["transports_disable"])
        if "transport" in raw:
            raw["transport"] = raw["transport"].strip().lower()
        if "nixl" in raw:
            raw["nixl"] = dict(kv.split("=", 1) for kv in raw["nixl"].split(",") if "=" in kv)
        raw.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return msgspec.convert(raw, cls, strict=False)
        except msgspec.ValidationError as exc:
            from .errors import InvalidArgument

            raise InvalidArgument(f"bad kvmesh engine configuration: {exc}") from None

    def transport_enabled(self, kind: TransportKind) -> bool:
        """Whether configuration lets ``kind`` serve transfers at all."""
        if self.transport is not None:
            return kind is self.transport
        if self.transports_allow is not None and kind not in self.transports_allow:
            return False
        return kind not in self.transports_disable
