"""Make LMCache 0.5.x's storage path importable on a CPU-only box for tests.

LMCache's package import resolves its device ops, which import its cachegen kernels, which
import ``numba`` for ``@njit`` only. Those kernels (KV compression) are never called on the
Mooncake connector's path, so where numba is not installed :func:`install_numba_stub` puts an
in-memory ``numba`` whose ``njit`` leaves the function as plain Python. It has a real module
spec and no distribution metadata, so a probe such as transformers' ``is_numba_available``
still says numba is absent. A real numba, when installed, is used as it is.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types


def lmcache_available() -> bool:
    """LMCache and transformers (its storage path imports its token database, which imports
    ``transformers.AutoTokenizer``) are both importable."""
    return all(importlib.util.find_spec(m) is not None for m in ("lmcache", "transformers"))


def _njit(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]  # @njit
    return lambda fn: fn  # @njit(cache=True)


def install_numba_stub() -> None:
    if "numba" in sys.modules or importlib.util.find_spec("numba") is not None:
        return
    mod = types.ModuleType("numba")
    mod.__spec__ = importlib.machinery.ModuleSpec("numba", None)
    mod.__file__ = None
    mod.__doc__ = "kvmesh test stand-in: njit leaves functions as Python (tests/plugins)"
    mod.njit = _njit  # type: ignore[attr-defined]
    mod.jit = _njit  # type: ignore[attr-defined]
    sys.modules["numba"] = mod
