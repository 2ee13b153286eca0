"""Request arguments: coercion of ops and integer arrays, and the one range check.

Every (offset, length) array the engine accepts -- from the caller of a batch, from a peer's
TCP data request, from a user of the NIXL agent wrapper -- goes through :func:`check_ranges`
before a byte moves: lengths positive, offsets non-negative, every ``[offset, offset +
length)`` inside its region, no 64-bit wrap-around, equal counts. Pure numpy, no I/O.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import InvalidArgument, InvalidLength, OutOfBounds
from .types import Op

__all__ = ["as_int64", "as_op", "as_requests", "check_ranges"]

# Below this many pieces Python ints beat a handful of numpy reductions (latency path).
_SMALL = 8
_I63 = 1 << 63
_INT64 = np.dtype(np.int64)


def as_op(op: Any) -> Op:
    """``op`` as an :class:`Op` (``Op.READ`` or ``"read"``); ``InvalidArgument`` otherwise."""
    if op.__class__ is Op:
        return op
    try:
        return Op(op)
    except ValueError:
        raise InvalidArgument(f"op must be Op.READ or Op.WRITE, got {op!r}") from None


def as_int64(name: str, value: Any, n: int | None = None, *, copy: bool = True) -> np.ndarray:
    """``value`` (array, sequence or, with ``n``, one integer) as a 1-D ``int64`` array.

    Refuses non-integer dtypes (``InvalidArgument``: a float offset is a caller bug, never
    rounded) and values of ``2**63`` or more (``OutOfBounds``). Negative values pass: the
    range check refuses them with the request's index. ``copy=True`` always copies, so a
    caller may reuse its arrays at once.
    """
    if type(value) is np.ndarray:
        arr = value
        if arr.dtype is _INT64 and arr.ndim == 1:  # the common case, checked first
            return arr.copy() if copy else arr
    else:
        try:
            arr = np.asarray(value)
        except (OverflowError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"{name} must be integers ({exc})") from None
        if arr.dtype is _INT64 and arr.ndim == 1:  # Python ints below 2**63: a fresh array
            return arr
        copy = False
    if arr.dtype.kind not in "iu" and (arr.size or arr.dtype.kind != "f"):  # [] is float64
        if arr is not value and _all_ints(value):
            # Python ints that no int64/uint64 array holds (numpy made floats or objects).
            raise OutOfBounds(f"{name} holds values beyond 2**63")
        raise InvalidArgument(f"{name} must be integers, got dtype {arr.dtype}")
    if arr.ndim == 0 and n is not None:
        return np.full(n, int(arr), dtype=np.int64)
    if arr.ndim != 1:
        raise InvalidArgument(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype == np.uint64 and len(arr) and int(arr.max()) >= _I63:
        raise OutOfBounds(f"{name} holds values beyond 2**63")
    if arr.dtype == np.int64:
        return arr.copy() if copy else arr
    return arr.astype(np.int64)


def as_requests(
    local: Any,
    remote: Any,
    lengths: Any,
    *,
    names: tuple[str, str] = ("local_offsets", "remote_offsets"),
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A caller's three request arrays as fresh ``int64`` arrays of one count.

    ``lengths`` may be one integer for every request. Coerced by :func:`as_int64`;
    ``InvalidLength`` when the counts differ. The ranges are checked later, against the
    regions, by :func:`check_ranges`.
    """
    lo = as_int64(names[0], local)
    ro = as_int64(names[1], remote)
    ln = as_int64("lengths", lengths, len(lo))
    if not (len(lo) == len(ro) == len(ln)):
        raise InvalidLength(
            f"requests need equal counts: {len(lo)} {names[0]}, {len(ro)} {names[1]}, "
            f"{len(ln)} lengths"
        )
    return lo, ro, ln


def _all_ints(value: Any) -> bool:
    try:
        items = np.asarray(value, dtype=object)
    except (TypeError, ValueError):
        return False
    return items.size > 0 and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in items.flat
    )


def check_ranges(what: str, lengths: np.ndarray, *sides: tuple[np.ndarray, int, object]) -> int:
    """Check pieces against their regions; return their total bytes.

    ``lengths`` and the offsets of each side ``(offsets, region size, region name)`` are 1-D
    ``int64`` or ``uint64`` arrays with one entry per piece. Raises ``InvalidLength`` for a
    count mismatch or a length that is not positive, ``OutOfBounds`` for a negative offset or
    a piece reaching past its region (computed without 64-bit wrap-around). ``what`` and the
    names only appear in error messages; a name may be a tuple of parts, joined with spaces
    only when an error is raised (a region's ``repr`` costs more than the check).
    """
    n = len(lengths)
    for offsets, _, name in sides:
        if len(offsets) != n:
            raise InvalidLength(
                f"{what}: {len(offsets)} offsets into {_name(name)} but {n} lengths"
            )
    if n == 0:
        return 0
    if n == 1:  # the latency path: one range
        c = lengths.tolist()[0]
        if c <= 0:
            raise InvalidLength(f"{what} #0: length {c} is not positive")
        for offsets, size, name in sides:
            o = offsets.tolist()[0]
            if o < 0 or o > size or c > size - o:
                raise _out_of_bounds(what, 0, o, c, size, name)
        return c
    if n <= _SMALL:
        lens = lengths.tolist()
        for i, c in enumerate(lens):
            if c <= 0:
                raise InvalidLength(f"{what} #{i}: length {c} is not positive")
        for offsets, size, name in sides:
            for i, o in enumerate(offsets.tolist()):
                c = lens[i]
                if o < 0 or o > size or c > size - o:
                    raise _out_of_bounds(what, i, o, c, size, name)
        return sum(lens)
    if lengths.dtype.kind == "i":
        bad_len = lengths <= 0
        ulen = lengths.view(np.uint64)
    else:
        bad_len = lengths == 0
        ulen = lengths
    if bad_len.any():
        i = int(np.flatnonzero(bad_len)[0])
        raise InvalidLength(f"{what} #{i}: length {int(lengths[i])} is not positive")
    for offsets, size, name in sides:
        if offsets.dtype.kind == "i":
            if int(offsets.min()) < 0:
                i = int(np.flatnonzero(offsets < 0)[0])
                raise _out_of_bounds(what, i, int(offsets[i]), int(lengths[i]), size, name)
            offsets = offsets.view(np.uint64)
        # offset <= size and length <= size - offset: no uint64 wrap-around possible.
        over = (offsets > size) | (ulen > size - np.minimum(offsets, size))
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise _out_of_bounds(what, i, int(offsets[i]), int(lengths[i]), size, name)
    # Every length fits its region, yet their sum may still pass 2**64 (uint64 sums wrap).
    if int(ulen.max()) * n < 1 << 64:
        return int(ulen.sum())
    return sum(ulen.tolist())


def _name(name: object) -> str:
    return " ".join(map(str, name)) if isinstance(name, tuple) else str(name)


def _out_of_bounds(what: str, i: int, o: int, c: int, size: int, name: object) -> OutOfBounds:
    if o < 0:
        return OutOfBounds(f"{what} #{i}: negative offset {o} into {_name(name)}")
    return OutOfBounds(f"{what} #{i}: range [{o}, +{c}) exceeds {_name(name)} ({size} bytes)")
