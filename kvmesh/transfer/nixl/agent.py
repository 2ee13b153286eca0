"""One NIXL agent with a UCX backend, safe to share between threads (engine-agnostic).

It knows addresses, registered regions, peer agents and READ/WRITE; nothing about segments,
batches or keys (:mod:`kvmesh.transfer.transports.nixl` builds the engine transport on it).
The pitfalls it handles are listed in docs/nixl.md; the jobs around it live next to it:
:mod:`.loader` (import, version, environment), :mod:`.patch` (the progress-thread patch),
:mod:`.errmap` (NIXL exceptions -> kvmesh errors), :mod:`.plan` (how a request becomes
descriptors), :mod:`.prepped` (the prepared-list cache), :mod:`.xfer` (transfer handles).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import (
    EngineClosed,
    InvalidArgument,
    InvalidLength,
    NotRegistered,
    PeerDeadError,
    TransferError,
    TransportUnavailable,
)
from .errmap import translate
from .loader import drop_empty_tls, require
from .patch import PATCH_TESTED_VERSIONS, ConfigPatch
from .plan import Plan, descriptor_table, granule_table, plan_request
from .prepped import Prepped, PreppedCache
from .types import Kind, NixlOptions, NixlRegion, RemoteRegion
from .xfer import NixlXfer

__all__ = ["NixlAgent"]

log = logging.getLogger("kvmesh.transfer.nixl")

_BACKEND = "UCX"
_BACKENDS = [_BACKEND]


def _has_key(engine_config: list[str], key: str) -> bool:
    return any(kv.split("=", 1)[0].strip().upper() == key for kv in engine_config)


class NixlAgent:
    """One NIXL agent with a UCX backend, safe to share between threads.

    >>> ag = NixlAgent("node-a")                       # doctest: +SKIP
    >>> reg = ag.register(arr.ctypes.data, arr.nbytes)  # doctest: +SKIP
    >>> md = ag.metadata()      # give to the peer through your control channel
    >>> peer = ag.add_remote(peer_md)                   # -> "node-b" (str)
    >>> with ag.make_xfer("READ", reg, [0], peer, remote, [0], [4096]) as x:
    ...     x.post() or x.wait(5.0)
    """

    def __init__(self, name: str, options: NixlOptions | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidArgument("a NIXL agent needs a non-empty str name")
        loaded = require()
        if drop_empty_tls():
            # Set after NIXL was imported: UCX reads it again for every backend.
            log.warning("NIXL: removed an empty UCX_TLS from the environment")
        self._loaded = loaded
        self.name = name
        self.options = opts = options or NixlOptions()
        self._lock = threading.RLock()
        self._closed = False
        self._regions: set[NixlRegion] = set()
        self._remotes: dict[str, bool] = {}  # name -> connected
        self._dead: dict[str, str] = {}
        self._prepped = PreppedCache(self._prepare_list, opts.max_cached_rows, self._lock)
        self._leaked: list[Any] = []
        self._notifs: dict[str, list[bytes]] = {}
        self._pump: threading.Thread | None = None
        self._pump_stop = threading.Event()
        self._active = time.monotonic()
        self.patch_note = ""
        params = self._backend_params()  # validates the options before anything is built

        mode = opts.progress
        if mode == "auto":
            mode = "thread" if loaded.patchable else "pump"
            if not loaded.patchable:
                self.patch_note = (
                    f"{loaded.module} {loaded.version} is not a wrapper version the progress-"
                    f"thread patch was checked against ({', '.join(sorted(PATCH_TESTED_VERSIONS))})"
                )
        ag = None
        if mode == "thread":
            patch = ConfigPatch(loaded.api, loaded.bind, opts.progress_delay_us)
            with patch:
                ag = self._new_agent(prog_thread=True)
            if not patch.verified():
                self.patch_note = "the pthrDelay patch did not reach the agent config"
                log.warning("NIXL: %s; using a pump thread instead", self.patch_note)
                del ag
                ag = None
                mode = "pump"
        if ag is None:
            ag = self._new_agent(prog_thread=False)
        self._ag = ag
        self.progress_mode: str = mode
        try:
            ag.create_backend(_BACKEND, params)
        except Exception as exc:
            raise TransportUnavailable(
                f"cannot create the NIXL UCX backend ({type(exc).__name__}: {exc}); check "
                f"UCX_TLS/UCX_NET_DEVICES and the options {params}"
            ) from None
        if mode == "pump":
            self._pump = threading.Thread(
                target=self._pump_loop, name=f"nixl-pump-{name}", daemon=True
            )
            self._pump.start()

    # --- creation -------------------------------------------------------------------------
    def _new_agent(self, prog_thread: bool) -> Any:
        api = self._loaded.api
        sync = {
            "strict": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            "rw": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
            "none": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE,
        }[self.options.sync_mode]
        cfg = api.nixl_agent_config(
            enable_prog_thread=prog_thread,
            enable_listen_thread=False,
            backends=[],
            sync_mode=sync,
            capture_telemetry=False,
        )
        try:
            return api.nixl_agent(self.name, cfg)
        except Exception as exc:
            raise TransportUnavailable(f"cannot create NIXL agent {self.name!r}: {exc}") from None

    def _backend_params(self) -> dict[str, str]:
        opts = self.options
        params = {
            "ucx_error_handling_mode": opts.error_handling,
            "num_workers": str(max(1, opts.num_workers)),
        }
        extra = [kv.strip() for kv in opts.engine_config.split(",") if kv.strip()]
        if opts.ucx_devices is not None:
            params["ucx_devices"] = opts.ucx_devices
            devices = opts.ucx_devices.strip()
            # NIXL's ucx_devices parameter alone leaves UCX's TCP transport listening on every
            # interface; NET_DEVICES in the agent's UCX configuration confines it. A list
            # cannot go through the comma-separated engine_config (UCX_NET_DEVICES can).
            if devices and "," not in devices and not _has_key(extra, "NET_DEVICES"):
                extra.append(f"NET_DEVICES={devices}")
        if opts.ucx_tls is not None:
            tls = opts.ucx_tls.strip()
            if not tls:
                raise InvalidArgument("ucx_tls must not be empty (UCX rejects an empty UCX_TLS)")
            if "," in tls:
                # engine_config is itself comma-separated, so a TLS list cannot go through it.
                raise InvalidArgument(
                    f"ucx_tls={tls!r}: give one transport name (e.g. 'tcp') or set UCX_TLS in "
                    f"the environment for a list"
                )
            extra.append(f"TLS={tls}")
        if extra:
            params["engine_config"] = ",".join(extra)
        return params

    def _pump_loop(self) -> None:
        # A 1 ms pump costs ~5 % of a core on its own; idle agents pump every 5 ms (the
        # first transfer after a quiet spell may wait that long for the passive side).
        busy = max(1e-4, self.options.pump_period_s)
        idle = max(busy, self.options.pump_idle_period_s)
        period = busy
        while not self._pump_stop.wait(period):
            try:
                new = self._ag.get_new_notifs()
            except Exception as exc:  # the agent is being torn down
                log.debug("NIXL pump stopped: %s", exc)
                return
            now = time.monotonic()
            if new:
                self._stash(new)
                self._active = now
            period = busy if now - self._active < 0.5 else idle

    def _stash(self, new: dict) -> None:
        with self._lock:
            for peer, msgs in new.items():
                key = peer.decode() if isinstance(peer, bytes) else peer
                self._notifs.setdefault(key, []).extend(msgs)

    # --- state ----------------------------------------------------------------------------
    def check_open(self) -> None:
        if self._closed:
            raise EngineClosed(f"NIXL agent {self.name!r} is closed")

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except TransferError:
            raise
        except Exception as exc:
            raise translate(self._loaded.errors, exc, what) from None

    def failed(self, exc: BaseException, what: str, peer: str) -> TransferError:
        """The kvmesh error for a failed transfer with ``peer``; remembers a dead peer."""
        err = exc if isinstance(exc, TransferError) else translate(self._loaded.errors, exc, what)
        if isinstance(err, PeerDeadError):
            self._mark_dead(peer, str(err))
        return err

    def _mark_dead(self, peer: str, reason: str) -> None:
        with self._lock:
            self._dead.setdefault(peer, reason)

    def leak(self, handle: Any) -> None:
        """A transfer handle NIXL refused to release: retried at :meth:`close`."""
        with self._lock:
            self._leaked.append(handle)

    # --- what a transfer handle (xfer.py) needs ------------------------------------------
    def xfer_post(self, handle: Any) -> str:
        return self._ag.transfer(handle)

    def xfer_state(self, handle: Any) -> str:
        return self._ag.check_xfer_state(handle)

    def unuse_prepped(self, prepped: tuple[Prepped, ...]) -> None:
        self._prepped.unuse(prepped)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def nixl_module(self) -> str:
        return self._loaded.module

    def peer_dead(self, peer: str) -> str | None:
        """Why a peer was found dead by a transfer, or ``None``."""
        return self._dead.get(peer)

    # --- memory ---------------------------------------------------------------------------
    def register(self, addr: int, size: int, kind: Kind = "DRAM", device: int = 0) -> NixlRegion:
        """Register ``size`` bytes at ``addr`` with the UCX backend only.

        Register big pools once: each region adds ~44 bytes to the agent metadata. VRAM needs a
        CUDA build of UCX and a CUDA device; it fails with ``TransportUnavailable`` otherwise.
        """
        self.check_open()
        if kind not in ("DRAM", "VRAM"):
            raise InvalidArgument(f"memory kind must be 'DRAM' or 'VRAM' (got {kind!r})")
        if int(size) <= 0:
            raise InvalidLength(f"cannot register {size} bytes: the size must be positive")
        if int(addr) <= 0:
            raise InvalidArgument(f"cannot register address {addr:#x}")
        ag = self._ag
        reg = ag.get_reg_descs([(int(addr), int(size), int(device), "")], kind)
        try:
            ag.register_memory(reg, backends=_BACKENDS)
        except Exception as exc:
            err = translate(
                self._loaded.errors, exc, f"registering {size} bytes of {kind} at {addr:#x}"
            )
            if kind == "VRAM":
                raise TransportUnavailable(
                    f"{err} (VRAM registration needs CUDA and a CUDA-enabled UCX)"
                ) from None
            raise err from None
        region = NixlRegion(int(addr), int(size), kind, int(device), reg)
        with self._lock:
            self._regions.add(region)
        return region

    def deregister(self, region: NixlRegion) -> None:
        """Deregister a region; cached descriptor lists over it are released. Idempotent."""
        with self._lock:
            if not region._live:
                return
            region._live = False
            self._regions.discard(region)
            self._prepped.drop(
                lambda key: key[0] == "" and key[1] == region.addr and key[2] == region.size
            )
        if self._closed:
            return
        self._call(
            "deregistering memory", self._ag.deregister_memory, region.reg, backends=_BACKENDS
        )

    # --- metadata -------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """Full agent metadata (connection info and every registered region)."""
        self.check_open()
        return bytes(self._call("reading local metadata", self._ag.get_agent_metadata))

    def partial_metadata(
        self, regions: Sequence[NixlRegion], include_connection: bool = True
    ) -> bytes:
        """Metadata for some regions only (216 B per region vs the whole agent).

        The regions must share one memory kind; with no regions it carries only the
        connection info (``include_connection`` must then be true).
        """
        self.check_open()
        kinds = {r.kind for r in regions}
        if len(kinds) > 1:
            raise InvalidArgument("partial metadata regions must share one memory kind")
        if not regions and not include_connection:
            raise InvalidArgument("partial metadata with no regions needs the connection info")
        for r in regions:
            if not r._live:
                raise NotRegistered(f"{r!r} is not registered")
        kind = next(iter(kinds)) if kinds else "DRAM"
        bind = self._loaded.bind
        seg = bind.DRAM_SEG if kind == "DRAM" else bind.VRAM_SEG
        descs = bind.nixlRegDList(seg, [(r.addr, r.size, r.device, "") for r in regions])
        return bytes(
            self._call(
                "reading partial metadata",
                self._ag.get_partial_agent_metadata,
                descs,
                include_connection,
                backends=_BACKENDS,
            )
        )

    def add_remote(self, metadata: bytes, connect: bool = True) -> str:
        """Load a peer's (full or partial) metadata; returns its agent name as ``str``."""
        self.check_open()
        if not isinstance(metadata, (bytes, bytearray, memoryview)) or not len(metadata):
            raise InvalidArgument("NIXL metadata must be non-empty bytes")
        raw = self._call("loading peer metadata", self._ag.add_remote_agent, bytes(metadata))
        name = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
        with self._lock:
            known = self._remotes.get(name)
            self._remotes.setdefault(name, False)
            self._dead.pop(name, None)
        if connect and not known:
            self.connect(name)
        return name

    def connect(self, peer: str) -> None:
        """Set up the endpoint now, not on the first transfer (10x faster first transfer)."""
        self.check_open()
        self._call(
            f"connecting to NIXL agent {peer!r}", self._ag.make_connection, peer, backends=_BACKENDS
        )
        with self._lock:
            self._remotes[peer] = True

    def has_remote(self, peer: str) -> bool:
        return peer in self._remotes or peer == self.name

    def remotes(self) -> list[str]:
        with self._lock:
            return list(self._remotes)

    def remove_remote(self, peer: str) -> None:
        """Forget a peer (local and instant); its cached descriptor lists are released."""
        with self._lock:
            if peer not in self._remotes:
                return
            del self._remotes[peer]
            self._prepped.drop(lambda key: key[0] == peer)
        if self._closed:
            return
        try:
            self._ag.remove_remote_agent(peer)
        except Exception as exc:
            log.debug("NIXL: removing peer %r: %s", peer, exc)

    # --- prepared descriptor lists ----------------------------------------------------------
    def _prepare_list(
        self, peer: str, addr: int, size: int, kind: str, device: int, granule: int
    ) -> tuple[Any, int]:
        table = granule_table(addr, size, granule, device)
        target = "NIXL_INIT_AGENT" if peer == "" else peer
        handle = self._call(
            f"preparing {len(table)} descriptors for {peer or 'local'} memory at {addr:#x}",
            self._ag.prep_xfer_dlist,
            target,
            table,
            kind,
            backends=_BACKENDS,
        )
        return handle, len(table)

    def cached_lists(self) -> int:
        """Number of prepared descriptor lists currently cached (tests, metrics)."""
        return len(self._prepped)

    def cached_rows(self) -> int:
        """Rows over every cached prepared list (bounded by ``max_cached_rows`` + in use)."""
        return self._prepped.rows

    # --- transfers --------------------------------------------------------------------------
    def make_xfer(
        self,
        op: str,
        local: NixlRegion,
        local_offsets: Any,
        peer: str,
        remote: RemoteRegion,
        remote_offsets: Any,
        lengths: Any,
        notif: bytes = b"",
        *,
        trusted: bool = False,
    ) -> NixlXfer:
        """Build (not post) one transfer of many (local offset, remote offset, length) pieces.

        ``op`` is ``"READ"`` (remote -> local) or ``"WRITE"`` (local -> remote); offsets are
        relative to the regions. Every piece is bounds-checked against both regions first.
        When every offset and length is a multiple of a common power-of-two granule, the
        request is built from cached prepared lists (10-100 µs for 64-1024 pieces); otherwise
        from explicit descriptors (``initialize_xfer``); :mod:`.plan` decides. ``trusted=True``
        skips the range checks for callers that already checked (the engine checks every
        request against both regions).
        """
        self.check_open()
        self._active = time.monotonic()
        opu = op.upper() if isinstance(op, str) else getattr(op, "value", str(op)).upper()
        if opu not in ("READ", "WRITE"):
            raise InvalidArgument(f"op must be READ or WRITE (got {op!r})")
        if not isinstance(local, NixlRegion) or not local._live:
            raise NotRegistered(f"local memory {local!r} is not registered with this agent")
        if not isinstance(remote, RemoteRegion):
            raise InvalidArgument(f"remote must be a RemoteRegion (got {type(remote).__name__})")
        dead = self._dead.get(peer)
        if dead is not None:
            raise PeerDeadError(f"NIXL peer {peer!r} is dead: {dead}")
        if not self.has_remote(peer):
            raise InvalidArgument(
                f"unknown NIXL peer agent {peer!r}: load its metadata with add_remote() first"
            )
        opts = self.options
        plan = plan_request(
            local_offsets,
            remote_offsets,
            lengths,
            local.size,
            remote.size,
            trusted=trusted,
            max_table_rows=opts.max_table_rows,
            max_expansion=opts.max_expansion,
        )
        if plan.prepared:
            return self._make_prepped(opu, local, peer, remote, plan, notif)
        return self._make_direct(opu, local, peer, remote, plan, notif)

    def _make_prepped(
        self, op: str, local: NixlRegion, peer: str, remote: RemoteRegion, plan: Plan, notif: bytes
    ) -> NixlXfer:
        granule = plan.granule
        with self._lock:
            self.check_open()
            lp = self._prepped.get("", local.addr, local.size, local.kind, local.device, granule)
            try:
                rp = self._prepped.get(
                    peer, remote.addr, remote.size, remote.kind, remote.device, granule
                )
            except BaseException:
                self._prepped.unuse((lp,))
                raise
        try:
            handle = self._ag.make_prepped_xfer(
                op, lp.handle, plan.local_idx, rp.handle, plan.remote_idx, notif, backends=_BACKENDS
            )
        except BaseException as exc:
            self._prepped.unuse((lp, rp))
            raise self.failed(exc, f"NIXL {op} with {peer!r}", peer) from None
        return NixlXfer(self, handle, (lp, rp), op, peer, plan.nbytes, plan.count, True)

    def _make_direct(
        self, op: str, local: NixlRegion, peer: str, remote: RemoteRegion, plan: Plan, notif: bytes
    ) -> NixlXfer:
        ltab = descriptor_table(plan.lo, plan.ln, local.addr, local.device)
        rtab = descriptor_table(plan.ro, plan.ln, remote.addr, remote.device)
        ag = self._ag
        try:
            handle = self._call(
                f"NIXL {op} with {peer!r}",
                ag.initialize_xfer,
                op,
                ag.get_xfer_descs(ltab, local.kind),
                ag.get_xfer_descs(rtab, remote.kind),
                peer,
                notif,
                backends=_BACKENDS,
            )
        except PeerDeadError as exc:
            self._mark_dead(peer, str(exc))
            raise
        return NixlXfer(self, handle, (), op, peer, plan.nbytes, plan.count, False)

    def transfer(
        self,
        op: str,
        local: NixlRegion,
        local_offsets: Any,
        peer: str,
        remote: RemoteRegion,
        remote_offsets: Any,
        lengths: Any,
        timeout: float | None = None,
        notif: bytes = b"",
    ) -> NixlXfer:
        """Build, post and wait for one transfer; the handle is always released."""
        xfer = self.make_xfer(
            op, local, local_offsets, peer, remote, remote_offsets, lengths, notif
        )
        try:
            if not xfer.post():
                xfer.wait(timeout)
        finally:
            xfer.release()
        return xfer

    # --- notifications ------------------------------------------------------------------------
    def send_notif(self, peer: str, message: bytes) -> None:
        """Send a small message to a peer agent (delivered through UCX active messages)."""
        self.check_open()
        self._call(f"notifying {peer!r}", self._ag.send_notif, peer, bytes(message))

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, keyed by sender name (``str``)."""
        self.check_open()
        if self._pump is None:
            new = self._call("reading notifications", self._ag.get_new_notifs)
            if new:
                self._stash(new)
        with self._lock:
            out, self._notifs = self._notifs, {}
        return out

    # --- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Release every handle, region and peer, stop the pump, drop the agent. Idempotent."""
        with self._lock:
            if self._closed:
                return
        self._pump_stop.set()
        if self._pump is not None:
            self._pump.join(timeout=5.0)
        with self._lock:
            self._prepped.close()
            for handle in self._leaked:
                try:
                    handle.release()
                except Exception as exc:
                    log.debug("NIXL close: leaked transfer handle: %s", exc)
            self._leaked.clear()
            for region in list(self._regions):
                region._live = False
                try:
                    self._ag.deregister_memory(region.reg, backends=_BACKENDS)
                except Exception as exc:
                    log.debug("NIXL close: deregister: %s", exc)
            self._regions.clear()
            for peer in list(self._remotes):
                try:
                    self._ag.remove_remote_agent(peer)
                except Exception as exc:
                    log.debug("NIXL close: remove peer %r: %s", peer, exc)
            self._remotes.clear()
            self._closed = True
            self._ag = None  # the C++ agent (and its progress thread) goes with the last ref

    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"NixlAgent({self.name!r}, {self._loaded.module} {self._loaded.version}, "
            f"progress={self.progress_mode}, closed={self._closed})"
        )
