"""Request planning: how one NIXL transfer of many pieces is described to NIXL.

Pure numpy, no NIXL import: tested in CPU-only CI without NIXL (tests/transfer/
test_nixl_plan.py). Given the pieces ``(local offset, remote offset, length)`` and the sizes
of both regions, :func:`plan_request` decides between

* **prepared**: indices into cached prepared descriptor lists of one row per ``granule``
  bytes of each region (``make_prepped_xfer``, 10-100 us for 64-1024 pieces). The granule is
  the largest power of two dividing every offset and length, so uniform page batches index
  pages directly and mixed sizes expand into granules (NIXL merges adjacent descriptors
  again);
* **direct**: explicit descriptors (``initialize_xfer``), when the granule is so small that
  a prepared list would exceed ``max_table_rows`` rows, or the expansion into granules would
  exceed ``max_expansion`` indices per piece.

:func:`descriptor_table` and :func:`granule_table` build the ``(addr, len, device)`` rows
NIXL takes for either.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidLength
from ..ranges import as_int64, check_ranges

__all__ = ["Plan", "descriptor_table", "granule_table", "plan_request"]

_SMALL = 8  # pieces up to which Python ints beat numpy reductions (the latency path)
_UINT64 = np.dtype(np.uint64)
_INT64 = np.dtype(np.int64)


class Plan:
    """The outcome of :func:`plan_request`.

    ``prepared``: ``local_idx``/``remote_idx`` (``int32``) index rows of ``granule`` bytes;
    ``count`` is their number. Otherwise ``lo``/``ro``/``ln`` (``uint64``) are the pieces
    for explicit descriptors and ``count`` is the number of pieces.
    """

    __slots__ = (
        "prepared",
        "granule",
        "nbytes",
        "count",
        "local_idx",
        "remote_idx",
        "lo",
        "ro",
        "ln",
    )

    def __init__(
        self,
        prepared: bool,
        granule: int,
        nbytes: int,
        lo: np.ndarray,
        ro: np.ndarray,
        ln: np.ndarray,
        local_idx: np.ndarray | None = None,
        remote_idx: np.ndarray | None = None,
    ) -> None:
        self.prepared = prepared
        self.granule = granule
        self.nbytes = nbytes
        self.lo = lo
        self.ro = ro
        self.ln = ln
        self.local_idx = local_idx
        self.remote_idx = remote_idx
        self.count = len(local_idx) if local_idx is not None else len(ln)

    def __repr__(self) -> str:
        how = f"prepared, granule {self.granule}" if self.prepared else "direct"
        return f"Plan({how}, {self.count} descriptors, {self.nbytes} bytes)"


def _trusted(values: Any, name: str) -> np.ndarray:
    """Arrays a caller already validated (non-negative integers): no checks, no copies."""
    if type(values) is np.ndarray and values.ndim == 1:
        dtype = values.dtype
        if dtype is _UINT64:
            return values
        if dtype is _INT64:
            return values.view(_UINT64)
    return as_int64(name, values, copy=False).view(np.uint64)


def plan_request(
    local_offsets: Any,
    remote_offsets: Any,
    lengths: Any,
    local_size: int,
    remote_size: int,
    *,
    trusted: bool = False,
    max_table_rows: int = 1 << 20,
    max_expansion: int = 16,
) -> Plan:
    """Check (unless ``trusted``) and plan one transfer; see the module docstring.

    Offsets are relative to the regions. Raises ``InvalidLength``/``OutOfBounds``/
    ``InvalidArgument`` for bad pieces (:func:`kvmesh.transfer.ranges.check_ranges`) and
    ``InvalidLength`` for a transfer without pieces. ``trusted=True`` skips every check for
    callers that already checked the pieces against both regions (the engine does).
    """
    if trusted:
        lo = _trusted(local_offsets, "local offsets")
        ro = _trusted(remote_offsets, "remote offsets")
        ln = _trusted(lengths, "lengths")
        if len(ln) == 0:
            raise InvalidLength("a transfer needs at least one piece")
        if len(lo) != len(ln) or len(ro) != len(ln):
            raise InvalidLength(
                f"offsets and lengths differ in count ({len(lo)}, {len(ro)}, {len(ln)})"
            )
    else:
        # A single integer is one piece (n=1 only applies to 0-d values).
        slo = as_int64("local offsets", local_offsets, 1, copy=False)
        sro = as_int64("remote offsets", remote_offsets, 1, copy=False)
        sln = as_int64("lengths", lengths, 1, copy=False)
        if len(sln) == 0:
            raise InvalidLength("a transfer needs at least one piece")
        check_ranges(
            "NIXL piece",
            sln,
            (slo, local_size, "the local region"),
            (sro, remote_size, "the remote region"),
        )
        lo, ro, ln = slo.view(np.uint64), sro.view(np.uint64), sln.view(np.uint64)
    n = len(ln)
    li = ri = None
    if n <= _SMALL:
        L, R, N = lo.tolist(), ro.tolist(), ln.tolist()
        acc = 0
        for a, b, c in zip(L, R, N):
            acc |= a | b | c
        nbytes = sum(N)
        granule = acc & -acc
        if N.count(granule) == n:  # uniform
            li = np.array([a // granule for a in L], dtype=np.int32)
            ri = np.array([b // granule for b in R], dtype=np.int32)
    else:
        nbytes = int(ln.sum())
        acc = int(np.bitwise_or.reduce(lo | ro | ln))
        granule = acc & -acc
        g = np.uint64(granule)
        uniform = bool((ln == g).all())
        if uniform:
            li = (lo // g).astype(np.int32)
            ri = (ro // g).astype(np.int32)
    if local_size // granule > max_table_rows or remote_size // granule > max_table_rows:
        return Plan(False, 0, nbytes, lo, ro, ln)
    if li is None or ri is None:
        pieces = nbytes // granule
        if pieces > max(max_expansion * n, n + 64):
            return Plan(False, 0, nbytes, lo, ro, ln)
        # Expand each piece into its granules; NIXL merges the adjacent descriptors again.
        g = np.uint64(granule)
        counts = (ln // g).astype(np.int64)
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        step = np.arange(pieces, dtype=np.int64) - starts
        li = (np.repeat((lo // g).astype(np.int64), counts) + step).astype(np.int32)
        ri = (np.repeat((ro // g).astype(np.int64), counts) + step).astype(np.int32)
    return Plan(True, granule, nbytes, lo, ro, ln, li, ri)


def descriptor_table(
    offsets: np.ndarray, lengths: np.ndarray, addr: int, device: int
) -> np.ndarray:
    """``(n, 3)`` ``uint64`` rows ``(addr + offset, length, device)`` (explicit descriptors)."""
    table = np.empty((len(lengths), 3), dtype=np.uint64)
    table[:, 0] = offsets + np.uint64(addr)
    table[:, 1] = lengths
    table[:, 2] = device
    return table


def granule_table(addr: int, size: int, granule: int, device: int) -> np.ndarray:
    """One ``(addr, granule, device)`` row per whole ``granule`` of a region (a prepared list)."""
    rows = size // granule
    table = np.empty((rows, 3), dtype=np.uint64)
    table[:, 0] = np.arange(rows, dtype=np.uint64) * np.uint64(granule) + np.uint64(addr)
    table[:, 1] = granule
    table[:, 2] = device
    return table
