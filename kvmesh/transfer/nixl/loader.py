"""Finding and loading the NIXL Python package, its version, and UCX's environment.

NIXL is optional: nothing here imports it at module import time. :func:`load` imports it
once per process (after :func:`prepare_environment`, since UCX reads its environment when it
loads); :func:`available` and :func:`installed_reason` answer without raising when it is
missing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import MutableMapping
from typing import Any

from ..errors import TransferError, TransportUnavailable
from .errmap import error_map
from .patch import PATCH_TESTED_VERSIONS

__all__ = [
    "Loaded",
    "available",
    "drop_empty_tls",
    "has_rdma_devices",
    "installed_reason",
    "load",
    "nixl_version",
    "prepare_environment",
    "require",
    "unavailable_reason",
]

log = logging.getLogger("kvmesh.transfer.nixl")


class Loaded:
    """The imported NIXL package: its ``_api`` and ``_bindings`` modules and what we know of it."""

    __slots__ = ("module", "version", "api", "bind", "patchable", "errors")

    def __init__(self, module: str, version: str | None, api: Any, bind: Any) -> None:
        self.module = module
        self.version = version
        self.api = api
        self.bind = bind
        trust = os.environ.get("KVMESH_NIXL_TRUST_PATCH", "") not in ("", "0")
        self.patchable = trust or version in PATCH_TESTED_VERSIONS
        self.errors: dict[type, type[TransferError]] = error_map(bind)


_load_lock = threading.Lock()
_loaded: Loaded | None = None
_load_error: str | None = None
_load_tried = False


def has_rdma_devices() -> bool:
    """Whether the host has RDMA (InfiniBand/RoCE) devices UCX could use."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def prepare_environment(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Set the environment UCX/NIXL read at load time; returns what was changed.

    Must run before UCX is first loaded in the process (:func:`load` calls it before
    importing NIXL). Only fills in defaults: a value the user set is kept, except an empty
    ``UCX_TLS``, which makes backend creation fail and is removed.
    """
    env = os.environ if environ is None else environ
    changed: list[str] = []
    if "NIXL_LOG_LEVEL" not in env:
        env["NIXL_LOG_LEVEL"] = "WARN"
        changed.append("NIXL_LOG_LEVEL=WARN")
    if drop_empty_tls(env):
        changed.append("UCX_TLS unset (was empty)")
    if "UCX_MODULES" not in env and not has_rdma_devices():
        # The ib modules pull in the bundled libnl-route, whose ELF destructor crashes the
        # interpreter at exit; without RDMA devices they are useless anyway.
        env["UCX_MODULES"] = "^ib"
        changed.append("UCX_MODULES=^ib")
    return changed


def drop_empty_tls(environ: MutableMapping[str, str] | None = None) -> bool:
    """Remove an empty ``UCX_TLS`` (UCX reads it for every backend; empty fails creation)."""
    env = os.environ if environ is None else environ
    tls = env.get("UCX_TLS")
    if tls is not None and not tls.strip():
        del env["UCX_TLS"]
        return True
    return False


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


def load() -> Loaded | None:
    """Import NIXL once per process; ``None`` when it cannot (:func:`unavailable_reason`)."""
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
            _loaded = Loaded(name, _dist_version(name), api, bind)
            break
        else:
            _load_error = "NIXL is not installed or cannot load (" + "; ".join(problems) + ")"
        _load_tried = True
        return _loaded


def available() -> bool:
    """Whether a NIXL Python package can be imported here (never raises)."""
    global _load_error
    try:
        return load() is not None
    except Exception as exc:  # pragma: no cover - defensive: a crash in import machinery
        _load_error = f"NIXL import failed: {exc}"
        return False


def installed_reason() -> str | None:
    """Cheap check without importing NIXL: ``None`` when a NIXL package is installed.

    Lets an engine list NIXL as a transport at start-up without paying for the import and
    the UCX load (~0.5 s) until NIXL is first used; the real import may still fail later.
    """
    if _load_tried:
        return None if _loaded is not None else _load_error
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
    loaded = load() if available() else None
    return loaded.version if loaded else None


def require() -> Loaded:
    """The loaded package, or ``TransportUnavailable`` saying why there is none."""
    loaded = load()
    if loaded is None:
        raise TransportUnavailable(_load_error or "NIXL is not available")
    return loaded
