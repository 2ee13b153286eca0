"""Argument normalisation of the client's calls: one key or a batch, per-key offsets and
sizes as ints (a 1.5 or a "4096" refused, not truncated or parsed)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import errors as E

__all__ = ["int_array", "listify", "per_key"]


def per_key(value: Any, n: int, what: str, batch: bool) -> list[Any]:
    if batch and isinstance(value, (list, tuple, np.ndarray)):
        vals = list(value)
        if len(vals) != n:
            raise E.InvalidParams(f"{n} keys but {len(vals)} {what}")
        if set(map(type, vals)) == {int}:  # plain ints (the usual batch): nothing per value
            return vals
        return [None if v is None else _index(v, what) for v in vals]
    return [None if value is None else _index(value, what)] * n


def _index(v: Any, what: str) -> int:
    """``v`` as an int when it is one (numpy integers too); an offset of 1.5 or a size of
    ``"4096"`` is refused, not truncated or parsed (``int()`` would do both)."""
    if type(v) is int:
        return v
    if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
        return int(v)
    raise E.InvalidParams(f"{what} must be ints, got {v!r}")


_INT64_MAX = np.iinfo(np.int64).max
_BOOLS = (bool, np.bool_)


def int_array(values: Any) -> np.ndarray | None:
    """``values`` (an int or a sequence of ints) as int64, or None when some value is not an
    int (floats, strings, bools) or does not fit int64: ``np.asarray(v, np.int64)`` would
    truncate 1.5 to 1 and parse "4096"."""
    try:
        a = np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        return None
    k = a.dtype.kind
    if k == "i":
        if type(values) in (list, tuple) and _has_bool(values, a):
            return None
        return a.astype(np.int64, copy=False)
    if k == "u" and (not a.size or int(a.max()) <= _INT64_MAX):
        return a.astype(np.int64)
    if k == "f" and not a.size:  # np.asarray([]) is float64
        return a.astype(np.int64)
    return None


def _has_bool(values: list | tuple, a: np.ndarray) -> bool:
    """Whether the (nested) sequence ``values``, which numpy made the int array ``a``, holds a
    bool: ``np.asarray([10, True])`` is int64, so a bool among ints would pass for 1. Only
    the elements that are 0 or 1 can be one: those are looked at, not every element (a
    type per element was the cost of a batch's checks that columns avoid)."""
    low = a <= 1  # (a few more than 0 and 1: cheaper to find, and harmless to look at)
    if a.ndim == 1:
        return any(isinstance(values[i], _BOOLS) for i in np.flatnonzero(low).tolist())
    for ix in np.argwhere(low).tolist():
        v: Any = values
        for i in ix:
            v = v[i]
        if isinstance(v, _BOOLS):
            return True
    return False


def listify(keys: Any) -> tuple[list[Any], bool]:
    """``(keys as a list, whether the call was a batch)``: a list or tuple is a batch."""
    if isinstance(keys, (list, tuple)):
        return list(keys), True
    return [keys], False
