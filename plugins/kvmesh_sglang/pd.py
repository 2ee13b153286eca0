"""A drop-in for SGLang's ``MooncakeTransferEngine`` that moves PD KV pages with kvmesh.

SGLang's Mooncake PD backend (bootstrap, ZMQ control, TP/PP mapping, aux and state) stays as it
is; only its transfer engine is swapped (docs/sglang.md, "PD disaggregation"). The API and
return conventions are those of SGLang's ``MooncakeTransferEngine``:

* ``register``/``deregister`` raise ``RuntimeError`` on failure; ``batch_register``/
  ``batch_deregister`` return 0 on success and a negative code otherwise;
* ``transfer_sync`` and ``batch_transfer_sync`` are synchronous one-sided WRITEs into raw
  addresses of the peer named by ``session_id``; 0 means done, a negative code (below) means
  failed, and SGLang then blacklists the session;
* ``get_session_id`` is ``"kvmesh://<engine address>"``; a peer hands it back as ``session_id``.

Every registered region is published (named ``sglang-pd-<ptr>-<size>``), because a kvmesh peer
reaches only published memory: raw peer addresses outside what the peer registered are refused
before a byte moves. The process-wide :func:`kvmesh.transfer.get_engine` is used, so the HiCache
backend and this class share one engine, one set of registrations and one metrics view.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

import numpy as np

from kvmesh.transfer import (
    EngineClosed,
    InvalidArgument,
    InvalidLength,
    MemoryRegion,
    NotRegistered,
    Op,
    OutOfBounds,
    PeerDeadError,
    SegmentNotFound,
    TransferEngine,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
    get_engine,
    init_engine,
    memory_kind,
)

log = logging.getLogger("kvmesh.sglang.pd")

SESSION_PREFIX = "kvmesh://"
SEGMENT_PREFIX = "sglang-pd-"

# Negative return codes of transfer_sync / batch_transfer_sync (SGLang only tests "!= 0" / "< 0";
# distinct values tell the cause apart in its logs).
E_FAILED = -1  # any other transfer error
E_BAD_ARGUMENT = -2  # malformed lists, zero/negative lengths, bad session id
E_NOT_REGISTERED = -3  # a source address outside memory registered here
E_PEER_REGION = -4  # a destination address outside what the peer registered
E_PEER_DEAD = -5  # the decode peer died, closed, or refuses connections
E_TIMEOUT = -6  # past the deadline (hung peer), or connecting/authenticating timed out
E_UNREACHABLE = -7  # no transport reaches the peer (other connection errors)

_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (PeerDeadError, E_PEER_DEAD),
    (TransferTimeout, E_TIMEOUT),
    (SegmentNotFound, E_PEER_REGION),
    (OutOfBounds, E_PEER_REGION),
    (NotRegistered, E_NOT_REGISTERED),
    (InvalidLength, E_BAD_ARGUMENT),
    (InvalidArgument, E_BAD_ARGUMENT),
    (TransportUnavailable, E_UNREACHABLE),
    (EngineClosed, E_FAILED),
    (ConnectionError, E_UNREACHABLE),
    (TimeoutError, E_TIMEOUT),
)


def error_code(exc: BaseException) -> int:
    """The negative return code for a failed transfer."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return E_FAILED


def _env_float(name: str) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        val = float(raw)
    except ValueError:
        raise RuntimeError(f"{name}={raw!r} is not a number of seconds") from None
    if val <= 0:
        raise RuntimeError(f"{name} must be positive, got {raw!r}")
    return val


def _ib_device(ib_device: str | None, gpu_id: int) -> str | None:
    # The same string Mooncake's engine reports (SGLang compares it before reusing the engine).
    if os.environ.get("MC_FORCE_TCP") == "1":
        return ""
    # SGLang's parser, from the module that constructs us (never imported here: it is slow).
    mod = sys.modules.get("sglang.srt.distributed.device_communicators.mooncake_transfer_engine")
    parse = getattr(mod, "get_ib_devices_for_gpu", None)
    return parse(ib_device, gpu_id) if parse is not None else (ib_device or None)


def _shared_engine(hostname: str) -> TransferEngine:
    """The process-wide engine; created listening on ``hostname`` unless configured otherwise."""
    if os.environ.get("KVMESH_LISTEN"):
        return get_engine()
    try:
        host = f"[{hostname}]" if ":" in hostname and not hostname.startswith("[") else hostname
        return init_engine(listen=f"{host}:0")
    except InvalidArgument:
        # It already runs (the HiCache backend made it first) with its own listen address.
        eng = get_engine()
        log.warning(
            "kvmesh PD: reusing the shared engine at %s (SGLang's host is %s); set "
            "KVMESH_LISTEN for peers on other hosts",
            eng.address,
            hostname,
        )
        return eng


class KvmeshTransferEngine:
    """SGLang's ``MooncakeTransferEngine`` API on the process-wide kvmesh ``TransferEngine``."""

    def __init__(
        self, hostname: str, gpu_id: int | None = None, ib_device: str | None = None
    ) -> None:
        self.hostname = hostname
        self.gpu_id = gpu_id if gpu_id is not None else 0
        self.ib_device = _ib_device(ib_device, self.gpu_id)
        self.timeout = _env_float("KVMESH_SGLANG_PD_TIMEOUT")
        try:
            self.engine = _shared_engine(hostname)
        except Exception as exc:
            raise RuntimeError(
                f"kvmesh PD transfer engine failed to start on {hostname!r}: {exc!r}. Check the "
                "KVMESH_* settings (docs/sglang.md), or set KVMESH_SGLANG_PD=0 to run SGLang's own "
                "Mooncake engine instead."
            ) from exc
        self.session_id = SESSION_PREFIX + self.engine.address
        self._lock = threading.Lock()
        self._regions: dict[int, list[MemoryRegion]] = {}  # ptr -> regions we registered there
        self._sessions: dict[str, str] = {}  # session id -> engine address
        self._seen: set[tuple[str, str]] = set()  # (peer, transport) pairs already logged
        self.stats: dict[str, Any] = {
            "transfers": 0,
            "bytes": 0,
            "failures": 0,
            "by_transport": {},
            "by_code": {},
        }
        self._metrics = _Metrics.get()
        log.info(
            "kvmesh PD transfer engine ready: session %s, node %s, transports %s",
            self.session_id,
            self.engine.node_id,
            [k.value for k in self.engine.transports],
        )

    def __repr__(self) -> str:
        return f"KvmeshTransferEngine({self.session_id})"

    # --- registration -------------------------------------------------------------------------
    def _register_one(self, ptr: int, length: int) -> MemoryRegion | None:
        """Register and publish ``[ptr, ptr+length)``; None if we already did exactly that."""
        if not isinstance(ptr, (int, np.integer)) or not isinstance(length, (int, np.integer)):
            raise InvalidArgument(f"pointer and length must be integers, got {ptr!r}, {length!r}")
        ptr, length = int(ptr), int(length)
        if ptr <= 0 or length <= 0:
            raise InvalidArgument(f"cannot register {length} bytes at 0x{ptr:x}")
        with self._lock:
            if any(r.size == length for r in self._regions.get(ptr, ())):
                return None
        kind, device = memory_kind(ptr)  # the Mooncake API carries no memory kind
        region = self.engine.register_raw(
            ptr, length, kind, device, name=f"{SEGMENT_PREFIX}{ptr:x}-{length:x}"
        )
        with self._lock:
            self._regions.setdefault(ptr, []).append(region)
        return region

    def _deregister_ptr(self, ptr: int) -> bool:
        with self._lock:
            regions = self._regions.pop(int(ptr), [])
        for r in regions:
            self.engine.unregister(r)
        return bool(regions)

    def register(self, ptr: int, length: int) -> None:
        try:
            self._register_one(ptr, length)
        except Exception as exc:
            raise RuntimeError(
                f"kvmesh memory registration of {length} bytes at {ptr} failed: {exc}"
            ) from exc

    def deregister(self, ptr: int) -> None:
        try:
            found = self._deregister_ptr(ptr)
        except Exception as exc:
            raise RuntimeError(f"kvmesh memory deregistration at {ptr} failed: {exc}") from exc
        if not found:
            raise RuntimeError(f"kvmesh memory deregistration failed: nothing registered at {ptr}")

    def batch_register(self, ptrs: list[int], lengths: list[int]) -> int:
        """Register every region (device and host mixed); 0, or -1 with nothing left registered."""
        ptrs, lengths = list(ptrs), list(lengths)
        if len(ptrs) != len(lengths):
            log.error("kvmesh batch_register: %d pointers but %d lengths", len(ptrs), len(lengths))
            return E_BAD_ARGUMENT
        done: list[MemoryRegion] = []
        try:
            for ptr, length in zip(ptrs, lengths):
                region = self._register_one(ptr, length)
                if region is not None:
                    done.append(region)
        except Exception as exc:
            log.error("kvmesh batch_register failed (%s); rolled back %d region(s)", exc, len(done))
            for region in done:
                with self._lock:
                    same = self._regions.get(region.ptr, [])
                    if region in same:
                        same.remove(region)
                    if not same:
                        self._regions.pop(region.ptr, None)
                try:
                    self.engine.unregister(region)
                except TransferError:
                    pass
            return E_FAILED
        return 0

    def batch_deregister(self, ptrs: list[int]) -> int:
        """Deregister everything registered at each pointer; -1 if one was not registered."""
        rc = 0
        for ptr in ptrs:
            try:
                if not self._deregister_ptr(ptr):
                    rc = E_FAILED
            except Exception as exc:
                log.error("kvmesh batch_deregister at %s failed: %s", ptr, exc)
                rc = E_FAILED
        return rc

    # --- transfers ------------------------------------------------------------------------------
    def _address(self, session_id: str) -> str:
        addr = self._sessions.get(session_id)
        if addr is None:
            if not isinstance(session_id, str) or not session_id.startswith(SESSION_PREFIX):
                raise InvalidArgument(
                    f"session {session_id!r} is not a kvmesh session: is the peer running SGLang "
                    "with the kvmesh PD plugin (KVMESH_SGLANG_PD) too?"
                )
            addr = session_id[len(SESSION_PREFIX) :]
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise InvalidArgument(f"session {session_id!r} is not kvmesh://host:port")
            with self._lock:
                if len(self._sessions) > 4096:  # peers come and go; keep the table bounded
                    self._sessions.clear()
                self._sessions[session_id] = addr
        return addr

    def _write(self, session_id: str, src: Any, dst: Any, lengths: Any) -> int:
        t0 = time.perf_counter()
        try:
            address = self._address(session_id)
            src = np.asarray(src, dtype=np.int64)
            dst = np.asarray(dst, dtype=np.int64)
            lengths = np.asarray(lengths, dtype=np.int64)
            if not (src.ndim == dst.ndim == lengths.ndim == 1):
                raise InvalidArgument("buffers, peer addresses and lengths must be flat lists")
            res = self.engine.transfer_by_address(
                Op.WRITE, address, src, dst, lengths, timeout=self.timeout
            )
        except Exception as exc:
            code = error_code(exc)
            with self._lock:
                self.stats["failures"] += 1
                self.stats["by_code"][code] = self.stats["by_code"].get(code, 0) + 1
            if self._metrics is not None:
                self._metrics.failures.labels(code=str(code)).inc()
            log.warning(
                "kvmesh PD write to %s failed (code %d): %s: %s",
                session_id,
                code,
                type(exc).__name__,
                exc,
            )
            return code
        transport = res.transports[0].value if res.transports else "none"
        with self._lock:
            self.stats["transfers"] += 1
            self.stats["bytes"] += res.nbytes
            if res.nbytes:  # an empty call moved nothing: no transport to credit
                bt = self.stats["by_transport"]
                bt[transport] = bt.get(transport, 0) + res.nbytes
            first = (session_id, transport) not in self._seen
            if first and len(self._seen) < 4096:
                self._seen.add((session_id, transport))
        if first:
            log.info("kvmesh PD: first write to %s served by %s", session_id, transport)
        if self._metrics is not None:
            self._metrics.bytes.labels(transport=transport).inc(res.nbytes)
            self._metrics.seconds.observe(time.perf_counter() - t0)
        return 0

    def transfer_sync(
        self, session_id: str, buffer: int, peer_buffer_address: int, length: int
    ) -> int:
        """WRITE ``length`` bytes at ``buffer`` to the peer's ``peer_buffer_address``; 0 or < 0."""
        return self._write(session_id, (buffer,), (peer_buffer_address,), (length,))

    def batch_transfer_sync(
        self,
        session_id: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
    ) -> int:
        """WRITE every block as one synchronous batch; 0 when all landed, else < 0."""
        if len(buffers) != len(peer_buffer_addresses) or len(buffers) != len(lengths):
            log.warning(
                "kvmesh PD write to %s refused: %d buffers, %d peer addresses, %d lengths",
                session_id,
                len(buffers),
                len(peer_buffer_addresses),
                len(lengths),
            )
            return E_BAD_ARGUMENT
        return self._write(session_id, buffers, peer_buffer_addresses, lengths)

    # --- the rest of the API ----------------------------------------------------------------------
    def get_session_id(self) -> str:
        return self.session_id

    def send_probe(self, peer_session_id: str) -> int:
        """0 when the peer's engine answers (bounded by the control timeout), else < 0."""
        try:
            self.engine.ping(self._address(peer_session_id))
        except Exception as exc:
            log.debug("kvmesh probe of %s failed: %s", peer_session_id, exc)
            return error_code(exc)
        return 0

    def get_engine(self) -> TransferEngine:
        return self.engine

    def get_ib_device(self) -> str | None:
        return self.ib_device

    def initialize(self, hostname: str, device_name: str | None) -> None:
        """Mooncake's explicit initialisation: the kvmesh engine is started in ``__init__``."""


class _Metrics:
    """Prometheus counters (with SGLang's multi-process collector they reach its /metrics)."""

    _inst: Any = False
    _lock = threading.Lock()

    def __init__(self, prom: Any) -> None:
        self.bytes = prom.Counter("kvmesh_pd_bytes", "PD KV bytes written by kvmesh", ["transport"])
        self.failures = prom.Counter(
            "kvmesh_pd_failures", "failed PD writes by return code", ["code"]
        )
        self.seconds = prom.Histogram(
            "kvmesh_pd_write_seconds", "duration of one PD batch write (batch_transfer_sync)"
        )

    @classmethod
    def get(cls) -> _Metrics | None:
        with cls._lock:
            if cls._inst is False:
                try:
                    import prometheus_client

                    cls._inst = cls(prometheus_client)
                except Exception:  # absent, or registered twice by a reloaded module
                    cls._inst = None
            return cls._inst
