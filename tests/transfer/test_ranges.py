"""kvmesh.transfer.ranges: the one range check and the argument coercions (pure numpy)."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.transfer import InvalidArgument, InvalidLength, Op, OutOfBounds
from kvmesh.transfer.ranges import as_int64, as_op, as_requests, check_ranges


def _u(*v):
    return np.array(v, dtype=np.uint64)


def _i(*v):
    return np.array(v, dtype=np.int64)


@pytest.mark.parametrize("n", [1, 20])  # the Python-int path and the vectorised path
@pytest.mark.parametrize("arr", [_u, _i])
def test_check_ranges(n, arr):
    def pieces(off, ln, size=100):
        offs = arr(*([0] * (n - 1) + [off]))
        lens = arr(*([1] * (n - 1) + [ln]))
        return check_ranges("x", lens, (offs, size, "seg"))

    assert pieces(50, 50) == n - 1 + 50
    assert pieces(99, 1) == n - 1 + 1
    with pytest.raises(InvalidLength, match=f"x #{n - 1}: length 0"):
        pieces(0, 0)
    with pytest.raises(OutOfBounds, match=rf"x #{n - 1}: range \[60, \+41\) exceeds seg"):
        pieces(60, 41)
    with pytest.raises(OutOfBounds):
        pieces(101, 1)
    if arr is _u:
        with pytest.raises(OutOfBounds):
            pieces(2**64 - 10, 20)  # offset + length wraps around to 10
        with pytest.raises(OutOfBounds):
            pieces(10, 2**64 - 5)
    else:
        with pytest.raises(InvalidLength):
            pieces(0, -5)
        with pytest.raises(OutOfBounds, match="negative offset -1 into seg"):
            pieces(-1, 5)
        with pytest.raises(OutOfBounds):
            pieces(2**63 - 1, 2)


def test_check_ranges_two_sides_counts_and_names():
    lo, ro, ln = _i(0, 10), _i(0, 95), _i(10, 10)
    assert check_ranges("w", ln, (lo, 100, "local"), (ro, 200, "remote")) == 20
    with pytest.raises(OutOfBounds, match=r"w #1: range \[95, \+10\) exceeds remote"):
        check_ranges("w", ln, (lo, 100, "local"), (ro, 100, "remote"))
    with pytest.raises(InvalidLength, match="1 offsets into local"):
        check_ranges("w", ln, (lo[:1], 100, "local"), (ro, 200, "remote"))
    # a tuple name is joined only when the error is raised
    with pytest.raises(OutOfBounds, match="exceeds remote segment 'kv'"):
        check_ranges("w", ln, (ro, 100, ("remote segment", "'kv'")))
    assert check_ranges("w", _u(), (_u(), 0, "x")) == 0


def test_total_does_not_wrap():
    # Nine pieces of 2**62 bytes each fit a region of 2**64 - 1 bytes, but their sum does
    # not fit a uint64: the total must be exact, not the wrapped numpy sum.
    n = 9
    big = 1 << 62
    lens = np.full(n, big, np.uint64)
    offs = np.zeros(n, np.uint64)
    assert int(lens.sum()) != n * big  # what a plain numpy sum would report
    assert check_ranges("x", lens, (offs, (1 << 64) - 1, "seg")) == n * big


def test_as_int64():
    src = np.arange(5, dtype=np.int64)
    out = as_int64("a", src)
    assert out.dtype == np.int64 and out.tolist() == src.tolist()
    assert not np.shares_memory(out, src)  # the caller may reuse its array at once
    assert as_int64("a", src, copy=False) is src
    assert as_int64("a", np.arange(3, dtype=np.uint32)).dtype == np.int64
    assert as_int64("a", [1, 2]).tolist() == [1, 2]
    assert as_int64("a", 7, 3).tolist() == [7, 7, 7]
    assert as_int64("a", []).tolist() == []
    with pytest.raises(OutOfBounds, match="beyond 2\\*\\*63"):
        as_int64("a", np.array([1, 2**63], np.uint64))
    for bad in ([0, 2**63 + 5], [2**64], [2**70, 1]):
        with pytest.raises(OutOfBounds):
            as_int64("a", bad)
    for bad in ([1.5], np.array([1.0]), [True], ["1"], np.zeros((2, 2), np.int64), 7):
        with pytest.raises(InvalidArgument):
            as_int64("a", bad)


def test_as_op():
    assert as_op(Op.READ) is Op.READ
    assert as_op("write") is Op.WRITE
    with pytest.raises(InvalidArgument):
        as_op("copy")


def test_as_requests():
    lo, ro, ln = as_requests([0, 4096], np.array([8, 16], np.uint32), 4096)
    assert [a.dtype for a in (lo, ro, ln)] == [np.int64] * 3
    assert ln.tolist() == [4096, 4096] and ro.tolist() == [8, 16]
    with pytest.raises(InvalidLength, match="2 local_ptrs, 1 remote_ptrs"):
        as_requests([1, 2], [3], [4, 5], names=("local_ptrs", "remote_ptrs"))
    with pytest.raises(InvalidLength):
        as_requests([1, 2], [3, 4], [5])
