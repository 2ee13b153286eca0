"""SGLang's own Mooncake HiCache backend on kvmesh, unchanged: ``mooncake.store`` on demand.

SGLang's ``MooncakeStore`` (``--hicache-storage-backend mooncake``) imports
``mooncake.store.MooncakeDistributedStore`` lazily. :func:`install` makes that import resolve
to kvmesh's Mooncake-compatible class (:mod:`kvmesh.store.compat`), so the backend runs on a
kvmesh store with its own configuration (``master_server_address`` = kvmesh master addresses,
or ``"embedded"``). It is opt-in, and never shadows a real Mooncake installation silently:

* ``KVMESH_SGLANG_MOONCAKE=1``: install, unless a real ``mooncake`` package is importable
  (then a warning says so and Mooncake stays);
* ``KVMESH_SGLANG_MOONCAKE=force``: install even over a real Mooncake (with a warning);
* unset or ``0``: nothing happens.

:func:`load` is the ``sglang.srt.plugins`` entry point (``kvmesh_mooncake``), so SGLang's
scheduler processes install it before they build the backend.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import sys
import types

__all__ = ["ENV", "install", "installed", "load", "uninstall"]

log = logging.getLogger("kvmesh.sglang.mooncake")

ENV = "KVMESH_SGLANG_MOONCAKE"
_MARK = "__kvmesh_compat__"
_shadowed: dict[str, types.ModuleType] = {}  # a real Mooncake replaced by force, for uninstall


def installed() -> bool:
    """True when ``mooncake`` in ``sys.modules`` is kvmesh's stand-in."""
    return bool(getattr(sys.modules.get("mooncake"), _MARK, False))


def _real_mooncake() -> str | None:
    """Where a real Mooncake lives, or None."""
    mod = sys.modules.get("mooncake")
    if mod is not None:
        return None if getattr(mod, _MARK, False) else repr(getattr(mod, "__file__", mod))
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return None
    return None if spec is None else str(spec.origin or spec.submodule_search_locations)


def install(force: bool = False) -> bool:
    """Make ``import mooncake.store`` give kvmesh's classes; returns whether it did."""
    if installed():
        return True
    real = _real_mooncake()
    if real is not None:
        if not force:
            log.warning(
                "kvmesh: a real Mooncake is installed (%s); leaving it in place "
                "(%s=force replaces it with kvmesh for this process)",
                real,
                ENV,
            )
            return False
        log.warning("kvmesh: %s=force: mooncake.store now means kvmesh, shadowing %s", ENV, real)
    from kvmesh.store import compat

    pkg = types.ModuleType("mooncake")
    pkg.__spec__ = importlib.machinery.ModuleSpec("mooncake", None, is_package=True)
    pkg.__path__ = []  # a package: "import mooncake.store" resolves through sys.modules
    pkg.__doc__ = "kvmesh stand-in for Mooncake (kvmesh_sglang.mooncake_compat)"
    setattr(pkg, _MARK, True)
    store = types.ModuleType("mooncake.store")
    store.__spec__ = importlib.machinery.ModuleSpec("mooncake.store", None)
    for name, obj in compat.module_names().items():  # every name of Mooncake's module
        setattr(store, name, obj)
    setattr(store, _MARK, True)
    pkg.store = store  # type: ignore[attr-defined]
    for name in ("mooncake", "mooncake.store"):
        if name in sys.modules:
            _shadowed[name] = sys.modules[name]
    sys.modules["mooncake"] = pkg
    sys.modules["mooncake.store"] = store
    log.info("kvmesh: mooncake.store -> kvmesh.store.compat (SGLang's Mooncake backends)")
    return True


def uninstall() -> None:
    """Remove the stand-in; a real Mooncake it shadowed comes back."""
    if installed():
        sys.modules.pop("mooncake.store", None)
        sys.modules.pop("mooncake", None)
        sys.modules.update(_shadowed)
        _shadowed.clear()


def load() -> None:
    """``sglang.srt.plugins`` entry point: install per ``KVMESH_SGLANG_MOONCAKE``; never raises."""
    mode = os.environ.get(ENV, "").strip().lower()
    if mode in ("", "0", "false", "no", "off"):
        return
    try:
        install(force=mode == "force")
    except Exception:
        log.exception("kvmesh: could not install the Mooncake stand-in; SGLang is unchanged")
