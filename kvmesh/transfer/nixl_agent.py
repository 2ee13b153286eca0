"""A robust wrapper around one NIXL agent with a UCX backend (engine-agnostic).

It knows addresses, registered regions, peer agents and READ/WRITE; nothing about segments,
batches or keys. :mod:`kvmesh.transfer.transports.nixl` builds the engine transport on it.

NIXL is optional: it is imported lazily on first use, and :func:`available` answers without
raising when it is missing. Everything here handles the pitfalls measured in
``docs/nixl.md`` (the shared nixl-notes):

* the stock Python wrapper hard-codes ``pthrDelay = 0`` so the UCX progress thread spins a
  whole core; we patch the binding's config class for the duration of agent creation so the
  thread polls with a 1 ms timeout. The patch is only applied to wrapper versions it was
  checked against and is verified at run time; otherwise the agent runs without a progress
  thread and a 1 ms pump thread gives the passive side its progress;
* ``UCX_TLS`` must never be empty; ``UCX_MODULES=^ib`` on hosts without RDMA devices avoids a
  segfault at interpreter exit (libnl's destructor); ``NIXL_LOG_LEVEL=WARN`` keeps NIXL's INFO
  lines off stdout. All three are set before UCX is first loaded;
* ``add_remote_agent`` returns ``bytes``: decoded once here, every name we hand out is ``str``;
* ``make_connection`` right after loading metadata (the first transfer is 10x slower without);
* descriptor lists are prepared once per (peer, region, page granule) and cached, batches are
  built with ``make_prepped_xfer`` from ``np.int32`` indices;
* NIXL raises exceptions (``nixlRemoteDisconnectError`` ...): mapped to kvmesh errors;
* every transfer handle is released, also on failure and timeout.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, Literal, Sequence

import msgspec
import numpy as np

from .errors import (
    Cancelled,
    EngineClosed,
    InvalidArgument,
    InvalidLength,
    NotRegistered,
    OutOfBounds,
    PeerDeadError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
)

__all__ = [
    "NixlAgent",
    "NixlOptions",
    "NixlRegion",
    "NixlXfer",
    "RemoteRegion",
    "available",
    "has_rdma_devices",
    "installed_reason",
    "nixl_version",
    "prepare_environment",
    "unavailable_reason",
]

log = logging.getLogger(__name__)

# Wrapper versions whose nixl_agent.__init__ was read and found to build its config through
# ``nixlBind.nixlAgentConfig()`` and then assign ``pthrDelay``: the patch below relies on that.
_PATCH_TESTED_VERSIONS = frozenset({"1.5.1"})
_BACKEND = "UCX"
_BACKENDS = [_BACKEND]

Kind = Literal["DRAM", "VRAM"]


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


class _Loaded:
    __slots__ = ("module", "version", "api", "bind", "patchable", "errors")

    def __init__(self, module: str, version: str | None, api: Any, bind: Any) -> None:
        self.module = module
        self.version = version
        self.api = api
        self.bind = bind
        trust = os.environ.get("KVMESH_NIXL_TRUST_PATCH", "") not in ("", "0")
        self.patchable = trust or version in _PATCH_TESTED_VERSIONS
        self.errors = _error_map(bind)


_load_lock = threading.Lock()
_loaded: _Loaded | None = None
_load_error: str | None = None
_load_tried = False


def has_rdma_devices() -> bool:
    """Whether the host has RDMA (InfiniBand/RoCE) devices UCX could use."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def prepare_environment(environ: Any = None) -> list[str]:
    """Set the environment UCX/NIXL read at load time; returns what was changed.

    Must run before UCX is first loaded in the process (it is called before ``import nixl``).
    Only fills in defaults: a value the user set is kept, except an empty ``UCX_TLS``, which
    makes backend creation fail and is removed.
    """
    env = os.environ if environ is None else environ
    changed: list[str] = []
    if "NIXL_LOG_LEVEL" not in env:
        env["NIXL_LOG_LEVEL"] = "WARN"
        changed.append("NIXL_LOG_LEVEL=WARN")
    tls = env.get("UCX_TLS")
    if tls is not None and not tls.strip():
        del env["UCX_TLS"]
        changed.append("UCX_TLS unset (was empty)")
    if "UCX_MODULES" not in env and not has_rdma_devices():
        # The ib modules pull in the bundled libnl-route, whose ELF destructor crashes the
        # interpreter at exit; without RDMA devices they are useless anyway.
        env["UCX_MODULES"] = "^ib"
        changed.append("UCX_MODULES=^ib")
    return changed


def _candidates() -> list[str]:
    forced = os.environ.get("KVMESH_NIXL_MODULE", "").strip()
    if forced:
        return [m.strip() for m in forced.split(",") if m.strip()]
    order = ["nixl_cu12", "nixl_cu13", "nixl"]
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None) if torch else None
    if isinstance(cuda, str) and cuda.startswith("13"):
        order = ["nixl_cu13", "nixl_cu12", "nixl"]
    return order


def _dist_version(module: str) -> str | None:
    for dist in (module.replace("_", "-"), module):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _load() -> _Loaded | None:
    global _loaded, _load_error, _load_tried
    if _load_tried:
        return _loaded
    with _load_lock:
        if _load_tried:
            return _loaded
        changed = prepare_environment()
        if changed:
            log.debug("NIXL environment defaults: %s", ", ".join(changed))
        problems = []
        for name in _candidates():
            try:
                api = importlib.import_module(name + "._api")
                bind = importlib.import_module(name + "._bindings")
            except Exception as exc:  # ImportError, OSError from a broken wheel ...
                problems.append(f"{name}: {type(exc).__name__}: {exc}")
                continue
            if not hasattr(api, "nixl_agent") or not hasattr(bind, "nixlAgentConfig"):
                problems.append(f"{name}: not a NIXL Python package")
                continue
            if os.environ.get("NIXL_LOG_LEVEL", "").upper() in ("WARN", "ERROR", "FATAL"):
                logging.getLogger("nixl").setLevel(logging.WARNING)
            _loaded = _Loaded(name, _dist_version(name), api, bind)
            break
        else:
            _load_error = "NIXL is not installed or cannot load (" + "; ".join(problems) + ")"
        _load_tried = True
        return _loaded


def available() -> bool:
    """Whether a NIXL Python package can be imported here (never raises)."""
    try:
        return _load() is not None
    except Exception as exc:  # pragma: no cover - defensive: a crash in import machinery
        global _load_error
        _load_error = f"NIXL import failed: {exc}"
        return False


def installed_reason() -> str | None:
    """Cheap check without importing NIXL: ``None`` when a NIXL package is installed.

    Lets an engine list NIXL as a transport at start-up without paying for the import and
    the UCX load (~0.5 s) until NIXL is first used; the real import may still fail later.
    """
    if _load_tried:
        return None if _loaded is not None else _load_error
    import importlib.util

    for name in _candidates():
        try:
            if importlib.util.find_spec(name) is not None:
                return None
        except (ImportError, ValueError):
            continue
    return "NIXL is not installed (tried " + ", ".join(_candidates()) + ")"


def unavailable_reason() -> str | None:
    """``None`` when NIXL is usable, else why not."""
    return None if available() else (_load_error or "NIXL is not available")


def nixl_version() -> str | None:
    """Installed version of the NIXL package in use (``None`` when unavailable)."""
    loaded = _load() if available() else None
    return loaded.version if loaded else None


def _require() -> _Loaded:
    loaded = _load()
    if loaded is None:
        raise TransportUnavailable(_load_error or "NIXL is not available")
    return loaded


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def _error_map(bind: Any) -> dict[type, type[TransferError]]:
    table = {
        "nixlRemoteDisconnectError": PeerDeadError,
        "nixlNotFoundError": NotRegistered,
        "nixlInvalidParamError": InvalidArgument,
        "nixlCancelledError": Cancelled,
        "nixlNotSupportedError": TransportUnavailable,
        "nixlNotAllowedError": TransferError,
        "nixlBackendError": TransferError,
        "nixlMismatchError": TransferError,
        "nixlNotPostedError": TransferError,
        "nixlRepostActiveError": TransferError,
        "nixlUnknownError": TransferError,
    }
    out: dict[type, type[TransferError]] = {}
    for name, cls in table.items():
        nixl_cls = getattr(bind, name, None)
        if isinstance(nixl_cls, type):
            out[nixl_cls] = cls
    return out


_HINTS = {
    PeerDeadError: "the peer agent disconnected or died",
    NotRegistered: "unknown peer agent, or memory not registered on one side",
    InvalidArgument: "NIXL rejected a parameter",
    TransportUnavailable: "not supported by the UCX backend here",
}


def _translate(loaded: _Loaded, exc: BaseException, what: str) -> TransferError:
    cls = loaded.errors.get(type(exc))
    if cls is None:
        return TransferError(f"{what}: {type(exc).__name__}: {exc}")
    hint = _HINTS.get(cls, "NIXL error")
    return cls(f"{what}: {hint} ({type(exc).__name__}: {exc})")


# --------------------------------------------------------------------------------------------
# Public value types
# --------------------------------------------------------------------------------------------


class NixlOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How to build a NIXL agent and its UCX backend.

    ``ucx_devices`` pins UCX to network devices (``"lo"`` for loopback-only tests; UCX's TCP
    transport otherwise multi-rails over every interface). ``ucx_tls`` restricts transports for
    this agent (``"tcp"`` forces the network path); it is never set empty. ``engine_config``
    holds extra UCX keys without the ``UCX_`` prefix, comma-separated, applied to this agent
    only. ``progress`` picks the progress scheme: ``"thread"`` (patched, polling progress
    thread), ``"pump"`` (no progress thread, a 1 ms Python pump) or ``"auto"`` (thread when the
    patch applies, else pump).
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
    def from_dict(cls, values: dict[str, str]) -> "NixlOptions":
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
    """A region of local memory registered with this agent (``register``/``deregister``)."""

    __slots__ = ("addr", "size", "kind", "device", "_reg", "_live", "__weakref__")

    def __init__(self, addr: int, size: int, kind: Kind, device: int, reg: Any) -> None:
        self.addr = addr
        self.size = size
        self.kind: Kind = kind
        self.device = device
        self._reg = reg
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


class _Prepped:
    """A cached prepared descriptor list: one row per ``granule`` bytes of a region."""

    __slots__ = ("key", "handle", "rows", "users", "dead")

    def __init__(self, key: tuple, handle: Any, rows: int) -> None:
        self.key = key
        self.handle = handle
        self.rows = rows
        self.users = 0
        self.dead = False


def _lowbit(x: int) -> int:
    return x & -x


def _as_offsets(values: Any, what: str) -> np.ndarray:
    if type(values) is np.ndarray and values.dtype == np.uint64 and values.ndim == 1:
        return values
    arr = np.asarray(values)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise InvalidArgument(f"{what} must be a 1-D array (got shape {arr.shape})")
    if arr.size == 0:
        return arr.astype(np.uint64)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} must hold integers (got {arr.dtype})")
    if arr.dtype.kind == "i" and len(arr) and int(arr.min()) < 0:
        bad = int(np.flatnonzero(arr < 0)[0])
        raise (InvalidLength if what == "lengths" else OutOfBounds)(
            f"{what}[{bad}] = {int(arr[bad])} is negative"
        )
    return arr.astype(np.uint64, copy=False)


def _trusted(values: Any) -> np.ndarray:
    """Arrays a caller already validated (non-negative integers): no checks, no copies."""
    if type(values) is np.ndarray and values.ndim == 1:
        if values.dtype == np.uint64:
            return values
        if values.dtype == np.int64:
            return values.view(np.uint64)
    return _as_offsets(values, "offsets")


# --------------------------------------------------------------------------------------------
# Transfers
# --------------------------------------------------------------------------------------------


class NixlXfer:
    """One NIXL transfer request: post it, poll or wait, release it (always).

    On the cma path :meth:`post` performs the whole copy inside the call (it releases the GIL):
    call it from a worker thread, never from an event loop. A DONE handle may be posted again
    to repeat the same transfer.
    """

    __slots__ = (
        "_agent",
        "_handle",
        "_prepped",
        "op",
        "peer",
        "nbytes",
        "count",
        "prepared",
        "_state",
    )

    def __init__(
        self,
        agent: "NixlAgent",
        handle: Any,
        prepped: tuple[_Prepped, ...],
        op: str,
        peer: str,
        nbytes: int,
        count: int,
        prepared: bool,
    ) -> None:
        self._agent = agent
        self._handle = handle
        self._prepped = prepped
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self.count = count
        self.prepared = prepared  # made from cached prepared lists (else initialize_xfer)
        self._state = "new"  # new | posted | done | failed | released

    @property
    def done(self) -> bool:
        return self._state == "done"

    def _what(self) -> str:
        return f"NIXL {self.op} of {self.nbytes} bytes ({self.count} descriptors) with {self.peer!r}"

    def _fail(self, exc: BaseException) -> TransferError:
        self._state = "failed"
        err = exc if isinstance(exc, TransferError) else _translate(
            self._agent._loaded, exc, self._what()
        )
        if isinstance(err, PeerDeadError):
            self._agent._mark_dead(self.peer, str(err))
        return err

    def post(self) -> bool:
        """Start the transfer; ``True`` when it already completed inside the call."""
        if self._state not in ("new", "done"):
            raise TransferError(f"{self._what()}: cannot post a handle in state {self._state}")
        agent = self._agent
        agent._check_open()
        try:
            status = agent._ag.transfer(self._handle)
        except Exception as exc:
            raise self._fail(exc) from None
        if status == "DONE":
            self._state = "done"
            return True
        if status == "PROC":
            self._state = "posted"
            return False
        raise self._fail(TransferError(f"{self._what()}: NIXL reported ERR when posting"))

    def poll(self) -> bool:
        """``True`` once every byte has landed; raises on failure."""
        state = self._state
        if state == "done":
            return True
        self._agent._check_open()
        if state != "posted":
            raise TransferError(f"{self._what()}: cannot poll a handle in state {state}")
        try:
            status = self._agent._ag.check_xfer_state(self._handle)
        except Exception as exc:
            raise self._fail(exc) from None
        if status == "DONE":
            self._state = "done"
            return True
        if status == "PROC":
            return False
        raise self._fail(TransferError(f"{self._what()}: NIXL reported ERR"))

    def wait(self, timeout: float | None = None, check: Any = None) -> None:
        """Poll until done. ``check()`` (optional) is called between polls and may raise.

        Each poll also drives UCX progress, which TCP transfers need from the initiator: the
        first 2 ms poll every ~20 µs (small transfers finish there), then the pause grows to
        1 ms so a long wait does not take a core from the copy itself.
        """
        if self.poll():
            return
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        pause = 2e-5
        while True:
            if check is not None:
                check()
            now = time.monotonic()
            if deadline is not None and now > deadline:
                self._state = "failed"
                raise TransferTimeout(f"{self._what()}: not finished after {timeout:.3f} s")
            time.sleep(pause)
            if now - start > 2e-3:
                pause = min(pause * 2, 1e-3)
            if self.poll():
                return

    def release(self) -> None:
        """Free the NIXL handle (cancelling it if still in flight). Idempotent."""
        if self._state == "released":
            return
        self._state = "released"
        agent = self._agent
        try:
            self._handle.release()
        except Exception as exc:
            # An in-flight handle NIXL could not cancel: keep it to retry at close.
            log.warning("%s: release failed (%s); retrying at agent close", self._what(), exc)
            with agent._lock:
                agent._leaked.append(self._handle)
        finally:
            agent._unuse(self._prepped)

    def __enter__(self) -> "NixlXfer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


# --------------------------------------------------------------------------------------------
# The agent
# --------------------------------------------------------------------------------------------


class _ConfigPatch:
    """Temporarily make ``nixlBind.nixlAgentConfig`` a subclass that overrides pthrDelay.

    The wrapper hard-codes ``pthrDelay = 0`` (a spinning progress thread); this is its only
    hook from Python. Applied under a lock, restored at once, and verified afterwards.
    """

    _lock = threading.Lock()

    def __init__(self, loaded: _Loaded, delay_us: int) -> None:
        self.loaded = loaded
        self.delay_us = max(1, int(delay_us))
        self.configs: list[Any] = []

    def __enter__(self) -> "_ConfigPatch":
        self._lock.acquire()
        bind = self.loaded.bind
        base = bind.nixlAgentConfig
        delay = self.delay_us
        made = self.configs

        class _Cfg(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any) -> None:
                super().__init__(*args)
                made.append(self)

            def __setattr__(self, key: str, value: Any) -> None:
                super().__setattr__(key, delay if key == "pthrDelay" else value)

        self._orig = base
        self.loaded.api.nixlBind.nixlAgentConfig = _Cfg
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.loaded.api.nixlBind.nixlAgentConfig = self._orig
        finally:
            self._lock.release()

    def verified(self) -> bool:
        return len(self.configs) == 1 and getattr(self.configs[0], "pthrDelay", None) == self.delay_us


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
        loaded = _require()
        tls = os.environ.get("UCX_TLS")
        if tls is not None and not tls.strip():
            # Set after NIXL was imported: UCX reads it again for every backend, and an empty
            # value makes backend creation fail.
            del os.environ["UCX_TLS"]
            log.warning("NIXL: removed an empty UCX_TLS from the environment")
        self._loaded = loaded
        self.name = name
        self.options = opts = options or NixlOptions()
        self._lock = threading.RLock()
        self._closed = False
        self._regions: set[NixlRegion] = set()
        self._remotes: dict[str, bool] = {}  # name -> connected
        self._dead: dict[str, str] = {}
        self._prepped: OrderedDict[tuple, _Prepped] = OrderedDict()
        self._cached_rows = 0
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
                    f"thread patch was checked against ({', '.join(sorted(_PATCH_TESTED_VERSIONS))})"
                )
        ag = None
        if mode == "thread":
            patch = _ConfigPatch(loaded, opts.progress_delay_us)
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
        if opts.ucx_devices is not None:
            params["ucx_devices"] = opts.ucx_devices
        extra = [kv.strip() for kv in opts.engine_config.split(",") if kv.strip()]
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
    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed(f"NIXL agent {self.name!r} is closed")

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except TransferError:
            raise
        except Exception as exc:
            raise _translate(self._loaded, exc, what) from None

    def _mark_dead(self, peer: str, reason: str) -> None:
        with self._lock:
            self._dead.setdefault(peer, reason)

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
        self._check_open()
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
            err = _translate(self._loaded, exc, f"registering {size} bytes of {kind} at {addr:#x}")
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
            self._drop_prepped(lambda key: key[0] == "" and key[1] == region.addr
                               and key[2] == region.size)
        if self._closed:
            return
        self._call("deregistering memory", self._ag.deregister_memory, region._reg,
                   backends=_BACKENDS)

    # --- metadata -------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """Full agent metadata (connection info and every registered region)."""
        self._check_open()
        return bytes(self._call("reading local metadata", self._ag.get_agent_metadata))

    def partial_metadata(
        self, regions: Sequence[NixlRegion], include_connection: bool = True
    ) -> bytes:
        """Metadata for some regions only (216 B per region vs the whole agent).

        The regions must share one memory kind; with no regions it carries only the
        connection info (``include_connection`` must then be true).
        """
        self._check_open()
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
        return bytes(self._call(
            "reading partial metadata", self._ag.get_partial_agent_metadata, descs,
            include_connection, backends=_BACKENDS,
        ))

    def add_remote(self, metadata: bytes, connect: bool = True) -> str:
        """Load a peer's (full or partial) metadata; returns its agent name as ``str``."""
        self._check_open()
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
        self._check_open()
        self._call(f"connecting to NIXL agent {peer!r}", self._ag.make_connection, peer,
                   backends=_BACKENDS)
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
            self._drop_prepped(lambda key: key[0] == peer)
        if self._closed:
            return
        try:
            self._ag.remove_remote_agent(peer)
        except Exception as exc:
            log.debug("NIXL: removing peer %r: %s", peer, exc)

    # --- prepared descriptor lists ----------------------------------------------------------
    def _prep(self, peer: str, addr: int, size: int, kind: str, device: int, granule: int
              ) -> _Prepped:
        """The cached prepared list for (peer, region, granule), with one more user.

        The caller holds ``_lock`` and must ``_unuse`` it. Counting the user before anything
        else is prepared keeps the eviction of that next list from releasing this one.
        """
        key = (peer, addr, size, kind, device, granule)
        entry = self._prepped.get(key)
        if entry is not None:
            self._prepped.move_to_end(key)
            entry.users += 1
            return entry
        rows = size // granule
        table = np.empty((rows, 3), dtype=np.uint64)
        table[:, 0] = np.arange(rows, dtype=np.uint64) * np.uint64(granule) + np.uint64(addr)
        table[:, 1] = granule
        table[:, 2] = device
        target = "NIXL_INIT_AGENT" if peer == "" else peer
        handle = self._call(
            f"preparing {rows} descriptors for {peer or 'local'} memory at {addr:#x}",
            self._ag.prep_xfer_dlist, target, table, kind, backends=_BACKENDS,
        )
        entry = _Prepped(key, handle, rows)
        entry.users = 1
        self._prepped[key] = entry
        self._cached_rows += rows
        self._evict()
        return entry

    def _evict(self) -> None:
        limit = self.options.max_cached_rows
        if self._cached_rows <= limit:
            return
        for key in list(self._prepped):
            if self._cached_rows <= limit:
                break
            entry = self._prepped[key]
            if entry.users == 0:
                self._release_prepped(entry)

    def _release_prepped(self, entry: _Prepped) -> None:
        if self._prepped.get(entry.key) is entry:
            del self._prepped[entry.key]
            self._cached_rows -= entry.rows
        entry.dead = True
        if entry.users == 0 and not self._closed:
            try:
                entry.handle.release()
            except Exception as exc:
                log.debug("NIXL: releasing a prepared list: %s", exc)

    def _drop_prepped(self, match: Any) -> None:
        for key in [k for k in self._prepped if match(k)]:
            self._release_prepped(self._prepped[key])

    def _unuse(self, entries: tuple[_Prepped, ...]) -> None:
        if not entries:
            return
        with self._lock:
            for entry in entries:
                entry.users -= 1
                if entry.dead and entry.users == 0 and not self._closed:
                    try:
                        entry.handle.release()
                    except Exception as exc:
                        log.debug("NIXL: releasing a prepared list: %s", exc)

    def cached_lists(self) -> int:
        """Number of prepared descriptor lists currently cached (tests, metrics)."""
        return len(self._prepped)

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
        from explicit descriptors (``initialize_xfer``). ``trusted=True`` skips the range checks
        for callers that already checked (the engine checks every request against both regions).
        """
        self._check_open()
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
        if trusted:
            lo, ro, ln = _trusted(local_offsets), _trusted(remote_offsets), _trusted(lengths)
        else:
            lo = _as_offsets(local_offsets, "local offsets")
            ro = _as_offsets(remote_offsets, "remote offsets")
            ln = _as_offsets(lengths, "lengths")
        n = len(ln)
        if n == 0:
            raise InvalidLength("a transfer needs at least one piece")
        if len(lo) != n or len(ro) != n:
            raise InvalidArgument(
                f"offsets and lengths differ in count ({len(lo)}, {len(ro)}, {n})"
            )
        if n <= 8:
            # Python ints beat a handful of numpy reductions for the latency path.
            L, R, N = lo.tolist(), ro.tolist(), ln.tolist()
            acc = 0
            for i in range(n):
                a, b, c = L[i], R[i], N[i]
                if not trusted:
                    if c == 0:
                        raise InvalidLength(f"lengths[{i}] is zero")
                    if a + c > local.size or b + c > remote.size:
                        side, o, size = (("local", a, local.size) if a + c > local.size
                                         else ("remote", b, remote.size))
                        raise OutOfBounds(
                            f"piece {i}: {side} offset {o} + length {c} exceeds the {side} "
                            f"region of {size} bytes"
                        )
                acc |= a | b | c
            nbytes = sum(N)
            granule = acc & -acc
            uniform = all(c == granule for c in N)
            if uniform:
                li = np.array([a // granule for a in L], dtype=np.int32)
                ri = np.array([b // granule for b in R], dtype=np.int32)
        else:
            if not trusted:
                if not ln.all():
                    bad = int(np.flatnonzero(ln == 0)[0])
                    raise InvalidLength(f"lengths[{bad}] is zero")
                self._check_ranges(lo, ro, ln, local.size, remote.size)
            nbytes = int(ln.sum())
            granule = _lowbit(int(np.bitwise_or.reduce(lo | ro | ln)))
            g = np.uint64(granule)
            uniform = bool((ln == g).all())
            if uniform:
                li = (lo // g).astype(np.int32)
                ri = (ro // g).astype(np.int32)
        opts = self.options
        if local.size // granule > opts.max_table_rows or remote.size // granule > opts.max_table_rows:
            return self._make_direct(opu, local, lo, peer, remote, ro, ln, nbytes, notif)
        if not uniform:
            pieces = nbytes // granule
            if pieces > max(opts.max_expansion * n, n + 64):
                return self._make_direct(opu, local, lo, peer, remote, ro, ln, nbytes, notif)
            # Expand each piece into its granules; NIXL merges the adjacent descriptors again.
            g = np.uint64(granule)
            counts = (ln // g).astype(np.int64)
            starts = np.repeat(np.cumsum(counts) - counts, counts)
            step = np.arange(pieces, dtype=np.int64) - starts
            li = (np.repeat((lo // g).astype(np.int64), counts) + step).astype(np.int32)
            ri = (np.repeat((ro // g).astype(np.int64), counts) + step).astype(np.int32)
        return self._make_prepped(opu, local, li, peer, remote, ri, granule, nbytes, notif)

    @staticmethod
    def _check_ranges(lo: np.ndarray, ro: np.ndarray, ln: np.ndarray, lsize: int,
                      rsize: int) -> None:
        for offs, region, side in ((lo, lsize, "local"), (ro, rsize, "remote")):
            ends = offs + ln
            # ends < offs catches uint64 wrap-around of huge offsets
            over = (ends > np.uint64(region)) | (ends < offs)
            if over.any():
                bad = int(np.flatnonzero(over)[0])
                raise OutOfBounds(
                    f"piece {bad}: {side} offset {int(offs[bad])} + length {int(ln[bad])} "
                    f"exceeds the {side} region of {region} bytes"
                )

    def _make_prepped(self, op: str, local: NixlRegion, li: np.ndarray, peer: str,
                      remote: RemoteRegion, ri: np.ndarray, granule: int, nbytes: int,
                      notif: bytes) -> NixlXfer:
        with self._lock:
            self._check_open()
            lp = self._prep("", local.addr, local.size, local.kind, local.device, granule)
            try:
                rp = self._prep(peer, remote.addr, remote.size, remote.kind, remote.device,
                                granule)
            except BaseException:
                self._unuse((lp,))
                raise
        try:
            handle = self._ag.make_prepped_xfer(op, lp.handle, li, rp.handle, ri, notif,
                                                backends=_BACKENDS)
        except BaseException as exc:
            self._unuse((lp, rp))
            err = _translate(self._loaded, exc, f"NIXL {op} with {peer!r}")
            if isinstance(err, PeerDeadError):
                self._mark_dead(peer, str(err))
            raise err from None
        return NixlXfer(self, handle, (lp, rp), op, peer, nbytes, len(li), True)

    def _make_direct(self, op: str, local: NixlRegion, lo: np.ndarray, peer: str,
                     remote: RemoteRegion, ro: np.ndarray, ln: np.ndarray, nbytes: int,
                     notif: bytes) -> NixlXfer:
        n = len(ln)
        ltab = np.empty((n, 3), dtype=np.uint64)
        ltab[:, 0] = lo + np.uint64(local.addr)
        ltab[:, 1] = ln
        ltab[:, 2] = local.device
        rtab = np.empty((n, 3), dtype=np.uint64)
        rtab[:, 0] = ro + np.uint64(remote.addr)
        rtab[:, 1] = ln
        rtab[:, 2] = remote.device
        ag = self._ag
        try:
            handle = self._call(
                f"NIXL {op} with {peer!r}", ag.initialize_xfer, op,
                ag.get_xfer_descs(ltab, local.kind), ag.get_xfer_descs(rtab, remote.kind),
                peer, notif, backends=_BACKENDS,
            )
        except PeerDeadError as exc:
            self._mark_dead(peer, str(exc))
            raise
        return NixlXfer(self, handle, (), op, peer, nbytes, n, False)

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
        xfer = self.make_xfer(op, local, local_offsets, peer, remote, remote_offsets, lengths,
                              notif)
        try:
            if not xfer.post():
                xfer.wait(timeout)
        finally:
            xfer.release()
        return xfer

    # --- notifications ------------------------------------------------------------------------
    def send_notif(self, peer: str, message: bytes) -> None:
        """Send a small message to a peer agent (delivered through UCX active messages)."""
        self._check_open()
        self._call(f"notifying {peer!r}", self._ag.send_notif, peer, bytes(message))

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, keyed by sender name (``str``)."""
        self._check_open()
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
            for entry in list(self._prepped.values()):
                try:
                    entry.handle.release()
                except Exception as exc:
                    log.debug("NIXL close: prepared list: %s", exc)
            self._prepped.clear()
            self._cached_rows = 0
            for handle in self._leaked:
                try:
                    handle.release()
                except Exception as exc:
                    log.debug("NIXL close: leaked transfer handle: %s", exc)
            self._leaked.clear()
            for region in list(self._regions):
                region._live = False
                try:
                    self._ag.deregister_memory(region._reg, backends=_BACKENDS)
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

    def __enter__(self) -> "NixlAgent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"NixlAgent({self.name!r}, {self._loaded.module} {self._loaded.version}, "
            f"progress={self.progress_mode}, closed={self._closed})"
        )
