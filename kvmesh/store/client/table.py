"""The master's replica table (GetReplicas, table form) checked and turned into numpy rows: a
reply that does not describe exactly one full copy per row group of each found key is
refused whole."""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Any

import numpy as np

from .. import errors as E
from .. import protocol as P
from ..types import (
    MAX_OBJECT_SIZE,
    ROW,
)

__all__ = ["NO_ROWS", "check_table", "run_heads"]


NO_ROWS = np.empty((0, ROW), np.int64)


assert array("q").itemsize == 8


def check_table(resp: P.ReplicaTableResp, n: int) -> tuple[Any, Any, np.ndarray]:
    """(codes, sizes, rows) of a table reply for ``n`` keys, checked: a reply that does not
    describe exactly one full copy per row group of each found key is refused whole (it
    would otherwise make us report bytes we never copied)."""
    bad = E.InternalError("the master sent a malformed replica table")
    if len(resp.codes) != n or len(resp.sizes) != n or len(resp.rows) % (8 * ROW):
        raise bad
    codes, sizes = resp.codes, resp.sizes
    if n == 1 and len(resp.rows) == 8 * ROW:  # a single get: the checks below, on five ints
        k, c, y, ro, ln = _ONE_ROW.unpack(resp.rows)
        if codes[0] != 0 or k or c or not 0 <= y < len(resp.segments) or ro < 0:
            raise bad
        if ln <= 0 or ln != sizes[0]:
            raise bad
        return codes, sizes, np.array([(k, c, y, ro, ln)], np.int64)
    flat = array("q")  # int64 (checked at import)
    flat.frombytes(resp.rows)
    if sys.byteorder != "little":
        flat.byteswap()
    rows = np.frombuffer(flat, np.int64).reshape(-1, ROW)
    if not flat:
        if 0 in codes:
            raise bad
        return _int64(codes, bad), _int64(sizes, bad), rows
    lo, hi = rows.min(0).tolist(), rows.max(0).tolist()
    if (
        lo[0] < 0
        or hi[0] >= n
        or lo[1] < 0
        or hi[1] >= len(rows)  # copies are numbered 0, 1, ... (and k * copies fits int64)
        or lo[2] < 0
        or hi[2] >= len(resp.segments)
        or lo[3] < 0
        or lo[4] <= 0
        # Slices of at most an object's size: their sum per copy (checked against the size
        # below) cannot wrap int64 (2**40 bytes x fewer than 2**23 rows in any reply).
        or hi[4] > MAX_OBJECT_SIZE
    ):
        raise bad
    codes = _int64(codes, bad)
    sizes = _int64(sizes, bad)
    found_mask = codes == 0
    k, c, ln = rows[:, 0], rows[:, 1], rows[:, 4]
    if hi[1] == 0 and len(k) == int(np.count_nonzero(found_mask)):
        # One copy of one slice per found key (the common case): the rows must be exactly
        # the found keys, in order, each slice the whole object.
        if not (np.array_equal(k, np.flatnonzero(found_mask)) and (ln == sizes[k]).all()):
            raise bad
        return codes, sizes, rows
    kc = k * (int(c.max()) + 1) + c
    if (
        (np.diff(kc) < 0).any()
        or not found_mask[k].all()
        or (np.bincount(k, minlength=n)[found_mask] == 0).any()
    ):
        raise bad
    heads = run_heads(kc)
    gk, gc = k[heads], c[heads]
    first = run_heads(gk)
    nth = np.arange(len(heads)) - np.repeat(first, np.diff(np.append(first, len(heads))))
    if (gc != nth).any() or (np.add.reduceat(ln, heads) != sizes[gk]).any():
        raise bad  # copies numbered 0, 1, ... per key, each exactly the object's size
    return codes, sizes, rows


def _int64(values: list[int], bad: E.StoreError) -> np.ndarray:
    """A reply's list of ints as int64, or ``bad``: msgpack ints reach 2**64 - 1, and an
    OverflowError must not escape a read as if it were the caller's bug."""
    try:
        return np.asarray(values, np.int64)
    except OverflowError:
        raise bad from None


def run_heads(v: np.ndarray) -> np.ndarray:
    """Indexes where a run of equal values in ``v`` starts (``v`` non-empty)."""
    return np.flatnonzero(np.concatenate(([True], v[1:] != v[:-1])))


_ONE_ROW = struct.Struct(f"<{ROW}q")  # one little-endian table row
