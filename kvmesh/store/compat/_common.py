"""What every compat method shares: pybind11-like argument checks (a malformed call raises
``TypeError`` before anything runs, as in Mooncake), result conversion to plain ints, and the
guard that turns whole-call failures into Mooncake's result shapes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ...transfer import TransferError
from .. import errors as E
from .constants import INVALID_PARAMS, OBJECT_EXISTS, code
from .types import ReplicateConfig

log = logging.getLogger("kvmesh.store.compat")

NO_SPACE = int(E.Code.NO_AVAILABLE_HANDLE)
T_MAX_SESSION = 1 << 32  # one staged session object (kvmesh stages sessions in memory)
_DEFAULT = ReplicateConfig()


class _Unsupported(Exception):
    """A tensor layout kvmesh does not store (answered -1012)."""


# ---------------------------------------------------------------------- argument checks
# pybind11 refuses a call whose arguments do not convert: TypeError, before anything runs.


def _key(k: Any) -> str:
    if not isinstance(k, str):
        raise TypeError(f"a key must be str, got {type(k).__name__}")
    return k


def _keys(ks: Any) -> list[str]:
    if isinstance(ks, (str, bytes)) or not isinstance(ks, (list, tuple)):
        raise TypeError(f"keys must be a list of str, got {type(ks).__name__}")
    for k in ks:
        _key(k)
    return list(ks)


def _int(v: Any, what: str = "value") -> int:
    if type(v) is bool or not isinstance(v, int):
        raise TypeError(f"{what} must be an int, got {type(v).__name__}")
    return int(v)


def _ints(vs: Any, what: str) -> list[int]:
    if isinstance(vs, (str, bytes)) or not isinstance(vs, (list, tuple)):
        raise TypeError(f"{what} must be a list of int, got {type(vs).__name__}")
    return [_int(v, what) for v in vs]


def _nested(vs: Any, what: str, depth: int) -> list:
    if depth == 1:
        return _ints(vs, what)
    if isinstance(vs, (str, bytes)) or not isinstance(vs, (list, tuple)):
        raise TypeError(f"{what} must be a nested list, got {type(vs).__name__}")
    return [_nested(v, what, depth - 1) for v in vs]


def _config(cfg: Any) -> ReplicateConfig:
    if cfg is None:
        return _DEFAULT
    if not isinstance(cfg, ReplicateConfig):
        raise TypeError(f"config must be a ReplicateConfig, got {type(cfg).__name__}")
    return cfg


def _res(r: Any) -> int:
    """One result of a StoreClient batch as Mooncake's int."""
    if isinstance(r, E.StoreError):
        return code(r.code)
    return 0 if r is None else code(r)


def _put_code(r: Any) -> int:
    """Mooncake's Python ``put`` of an existing key answers 0 (the object stays as it is)."""
    c = _res(r)
    return 0 if c == OBJECT_EXISTS else c


def _guard(fail: Callable[[int, tuple], Any]) -> Callable:
    """Whole-call failures (no store set up, no master reachable, a transfer engine error)
    in Mooncake's shape: ``fail(code, args)`` builds the result. ``TypeError`` is the one
    exception that passes: it is how Mooncake refuses a malformed call."""

    def wrap(fn: Callable) -> Callable:
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except TypeError:
                raise
            except E.StoreError as e:
                log.warning("kvmesh compat %s: %s", fn.__name__, e)
                return fail(code(e.code), args)
            except _NotSetUp:
                return fail(INVALID_PARAMS, args)
            except (TransferError, OSError, ValueError, RuntimeError, OverflowError) as e:
                log.warning("kvmesh compat %s failed: %s", fn.__name__, e)
                return fail(INVALID_PARAMS, args)

        inner.__name__ = fn.__name__
        inner.__qualname__ = fn.__qualname__
        inner.__doc__ = fn.__doc__
        inner.__wrapped__ = fn  # type: ignore[attr-defined]
        return inner

    return wrap


def _one(c: int, args: tuple) -> int:
    return c


def _none(c: int, args: tuple) -> None:
    return None


def _empty(c: int, args: tuple) -> bytes:
    return b""


def _each(c: int, args: tuple) -> list[int]:
    return [c] * len(args[0]) if args and isinstance(args[0], (list, tuple)) else []


def _each_none(c: int, args: tuple) -> list[None]:
    return [None] * len(args[0]) if args and isinstance(args[0], (list, tuple)) else []


def _each_empty(c: int, args: tuple) -> list[bytes]:
    return [b""] * len(args[0]) if args and isinstance(args[0], (list, tuple)) else []


def _empty_dict(c: int, args: tuple) -> dict:
    return {}


def _empty_list(c: int, args: tuple) -> list:
    return []


class _NotSetUp(Exception):
    """A method called before setup (or after close): Mooncake answers -600."""
