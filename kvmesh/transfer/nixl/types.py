"""Value types of the NIXL wrapper: agent options and the regions on both sides."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from ..errors import InvalidArgument

__all__ = ["Kind", "NixlOptions", "NixlRegion", "RemoteRegion"]

Kind = Literal["DRAM", "VRAM"]


class NixlOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How to build a NIXL agent and its UCX backend.

    ``ucx_devices`` confines UCX to network devices: one device name (``"lo"``) goes to the
    agent's UCX configuration as ``NET_DEVICES`` (which also keeps UCX's TCP listener off the
    other interfaces); a comma-separated list cannot travel that way and is only passed as
    NIXL's ``ucx_devices`` backend parameter (set ``UCX_NET_DEVICES`` in the environment to
    confine UCX to several devices). ``ucx_tls`` restricts transports for this agent
    (``"tcp"`` forces the network path); it is never set empty. ``engine_config`` holds extra
    UCX keys without the ``UCX_`` prefix, comma-separated, applied to this agent only.
    ``progress`` picks the progress scheme: ``"thread"`` (patched, polling progress thread),
    ``"pump"`` (no progress thread, a 1 ms Python pump) or ``"auto"`` (thread when the patch
    applies, else pump).
    """

    ucx_devices: str | None = None
    ucx_tls: str | None = None
    error_handling: Literal["peer", "none"] = "peer"
    num_workers: int = 1
    engine_config: str = ""
    progress: Literal["auto", "thread", "pump"] = "auto"
    progress_delay_us: int = 1000
    pump_period_s: float = 0.001  # while this agent moved data or got messages recently
    pump_idle_period_s: float = 0.005  # after 0.5 s without either
    sync_mode: Literal["strict", "rw", "none"] = "strict"
    max_table_rows: int = 1 << 20  # per prepared descriptor list
    max_cached_rows: int = 1 << 23  # over all cached prepared lists of the agent
    max_expansion: int = 16  # prepared indices per request before falling back to descs

    @classmethod
    def from_dict(cls, values: dict[str, str]) -> NixlOptions:
        """Build from string options (``EngineConfig.nixl`` / ``KVMESH_NIXL=k=v,...``)."""
        try:
            return msgspec.convert(dict(values), cls, strict=False)
        except msgspec.ValidationError as exc:
            raise InvalidArgument(f"bad NIXL options {values!r}: {exc}") from None


class RemoteRegion(msgspec.Struct, frozen=True):
    """A registered region of a peer agent, in the peer's address space."""

    addr: int
    size: int
    kind: Kind = "DRAM"
    device: int = 0


class NixlRegion:
    """A region of local memory registered with an agent (``register``/``deregister``)."""

    __slots__ = ("addr", "size", "kind", "device", "reg", "_live", "__weakref__")

    def __init__(self, addr: int, size: int, kind: Kind, device: int, reg: Any) -> None:
        self.addr = addr
        self.size = size
        self.kind: Kind = kind
        self.device = device
        self.reg = reg  # NIXL's registration handle (what the agent deregisters)
        self._live = True

    @property
    def live(self) -> bool:
        return self._live

    def remote(self) -> RemoteRegion:
        """How a peer names this region once it loaded our metadata."""
        return RemoteRegion(self.addr, self.size, self.kind, self.device)

    def __repr__(self) -> str:
        return (
            f"NixlRegion(0x{self.addr:x}, {self.size}, {self.kind}, dev={self.device}, "
            f"live={self._live})"
        )
