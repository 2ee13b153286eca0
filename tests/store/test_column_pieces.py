"""Multi-range objects named by raw-address columns (HiCache's layer_first pages: one range
per layer, a ``(objects, ranges)`` array): ``get_into_multi`` / ``put_from_multi`` resolve
them in one lookup (``Buffers._column_pieces``) and read them as columns
(``Reads._read_pieces``); the answers must be those of the per-range list form: the bytes
in order across the ranges, over one registration or several, and per key the error of a
missing object, an object of another size, a range outside registered memory."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.store import errors as E
from kvmesh.store.client import StoreClient

R = 4  # ranges per object
Z = 256  # bytes per range


@pytest.fixture(scope="module")
def client():
    with StoreClient(segment_size=8 << 20) as c:
        a = np.zeros(64 * R * Z, np.uint8)
        b = np.zeros(64 * R * Z, np.uint8)
        c.register_buffer(a)
        c.register_buffer(b)
        yield c, a, b


def _grid(a, b, n):
    """Object i's ranges: scattered over ``a`` and ``b`` (range q of object i in ``a`` for
    even q), out of order."""
    rows = []
    for i in range(n):
        rows.append(
            [
                (a if q % 2 == 0 else b).ctypes.data + ((7 * i + 3 * q) % (64 * R)) * Z
                for q in range(R)
            ]
        )
    return np.array(rows, np.int64)


def _fill(a, b, grid, value):
    for i, row in enumerate(grid.tolist()):
        for q, p in enumerate(row):
            arr = a if q % 2 == 0 else b
            off = p - arr.ctypes.data
            arr[off : off + Z] = value(i, q)


def _check(a, b, grid, value):
    for i, row in enumerate(grid.tolist()):
        for q, p in enumerate(row):
            arr = a if q % 2 == 0 else b
            off = p - arr.ctypes.data
            assert (arr[off : off + Z] == value(i, q)).all(), (i, q)


def _value(i, q):
    return (i * R + q) % 251 + 1


def test_columns_round_trip_in_range_order(client):
    c, a, b = client
    n = 12
    grid = _grid(a, b, n)
    sizes = np.full((n, R), Z, np.int64)
    cols = c._column_pieces(grid, sizes, n)
    assert cols is not None and len(set(cols.reg.ravel().tolist())) == 2  # both buffers
    assert list(cols.totals) == [R * Z] * n
    # One object (the scattered places of different objects overlap): its ranges in order.
    _fill(a, b, grid[:1], _value)
    assert c.put_from_multi(["cols-0"], grid[:1], sizes[:1]).ok
    a[:] = 0
    b[:] = 0
    got = c.get_into_multi(["cols-0"], grid[:1], sizes[0])  # one row of sizes for every key
    assert list(got) == [R * Z]
    _check(a, b, grid[:1], _value)


def test_columns_many_objects_same_bytes_as_lists(client):
    c, a, b = client
    n = 8
    # Disjoint places: object i's range q at slot i * R + q of its buffer.
    grid = np.array(
        [
            [(a if q % 2 == 0 else b).ctypes.data + (i * R + q) * Z for q in range(R)]
            for i in range(n)
        ],
        np.int64,
    )
    keys = [f"cols-many-{i}" for i in range(n)]
    _fill(a, b, grid, _value)
    assert c.put_from_multi(keys, grid, np.full((n, R), Z)).ok
    a[:] = 0
    b[:] = 0
    assert list(c.get_into_multi(keys, grid, np.full((n, R), Z))) == [R * Z] * n
    _check(a, b, grid, _value)
    # The list form reads the same bytes into the same places.
    a[:] = 0
    b[:] = 0
    assert list(c.get_into_multi(keys, grid.tolist(), [[Z] * R] * n)) == [R * Z] * n
    _check(a, b, grid, _value)


def test_columns_refusals_per_key(client):
    c, a, b = client
    n = 4
    grid = np.array(
        [[a.ctypes.data + (40 * R + i * R + q) * Z for q in range(R)] for i in range(n)], np.int64
    )
    keys = [f"cols-ref-{i}" for i in range(n)]
    _fill(a, b, grid, lambda i, q: 9)
    assert c.put_from_multi(keys[:2], grid[:2], np.full((2, R), Z)).ok
    # An object of another size: stored with 2 ranges, read with R (its bytes fit).
    assert c.put_from_multi([keys[2]], grid[2:3, :2], np.full((1, 2), Z)).ok
    got = c.get_into_multi(keys, grid, np.full((n, R), Z))
    assert got[0] == got[1] == R * Z  # the rest of the batch is read
    assert got[2] == 2 * Z  # a shorter object fills the leading ranges (general path)
    assert isinstance(got[3], E.ObjectNotFound)
    # A range outside registered memory: the columns are refused, the per-range path names
    # the key.
    bad = grid.copy()
    bad[1, 2] = 8  # not registered
    got = c.get_into_multi(keys[:2], bad[:2], np.full((2, R), Z))
    assert got[0] == R * Z and isinstance(got[1], E.NotRegistered)
    assert c._column_pieces(bad, np.full((n, R), Z), n) is None
    assert c._column_pieces(grid, np.full((n, R), 0), n) is None  # sizes must be positive
