"""``get_into_regions``: a batch read into memory the caller resolved once (region, offset and
size columns; HiCache's page tables) must land exactly the bytes the raw-address form lands,
one range or several per object, over one region or several, and refuse a column that
points outside its region before anything is read."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.store import errors as E
from kvmesh.store.client import StoreClient

SZ = 1000
N = 12


@pytest.fixture(scope="module")
def client():
    with StoreClient(segment_size=8 << 20) as c:
        a = np.zeros(64 * SZ, np.uint8)
        b = np.zeros(64 * SZ, np.uint8)
        ra, rb = c.register_buffer(a), c.register_buffer(b)
        keys = [f"cols-{i}" for i in range(N)]
        data = [np.full(SZ, i + 1, np.uint8) for i in range(N)]
        data[3][SZ // 2 :] = 200  # halves that differ: a swapped range shows
        assert c.put(keys, [d.tobytes() for d in data]).ok
        yield c, a, b, ra, rb, keys, data


def test_one_range_per_object_over_two_regions(client):
    c, a, b, ra, rb, keys, data = client
    a[:] = 0
    b[:] = 0
    reg = np.arange(N, dtype=np.int64) % 2  # even keys in a, odd in b, out of order
    off = ((7 * np.arange(N)) % 64 * SZ).astype(np.int64)
    got = c.get_into_regions(keys, [ra, rb], reg, off, SZ)
    assert list(got) == [SZ] * N and got.transports
    for i in range(N):
        arr = a if i % 2 == 0 else b
        assert (arr[off[i] : off[i] + SZ] == data[i]).all(), i
    # Exactly what the raw-address form of the same places reads.
    a[:] = 0
    b[:] = 0
    ptrs = np.where(reg == 0, a.ctypes.data, b.ctypes.data) + off
    assert list(c.get_into_raw(keys, ptrs, np.full(N, SZ))) == [SZ] * N
    for i in range(N):
        arr = a if i % 2 == 0 else b
        assert (arr[off[i] : off[i] + SZ] == data[i]).all(), i


def test_ranges_per_object_fill_in_order(client):
    c, a, b, ra, rb, keys, data = client
    a[:] = 0
    b[:] = 0
    # Object i: its first half in b, its second in a (regions per range, one row for all).
    off = np.stack([np.arange(N) * SZ, np.arange(N) * SZ + 32 * SZ], axis=1).astype(np.int64)
    got = c.get_into_regions(keys, [ra, rb], np.array([1, 0]), off, SZ // 2)
    assert list(got) == [SZ] * N
    for i in range(N):
        first, second = off[i]
        assert (b[first : first + SZ // 2] == data[i][: SZ // 2]).all(), i
        assert (a[second : second + SZ // 2] == data[i][SZ // 2 :]).all(), i


def test_missing_key_and_small_capacity_fail_alone(client):
    c, a, b, ra, rb, keys, data = client
    off = np.arange(3, dtype=np.int64) * SZ
    got = c.get_into_regions([keys[0], "cols-nope", keys[2]], [ra], 0, off, [SZ, SZ, SZ - 1])
    assert got[0] == SZ
    assert isinstance(got[1], E.ObjectNotFound)
    assert isinstance(got[2], E.BufferOverflow)


@pytest.mark.parametrize(
    "reg,off,size",
    [
        (0, [63 * SZ + 1], SZ),  # past the region's end by one byte
        (2, [0], SZ),  # no such region
        (0, [-1], SZ),
        (0, [0], 0),
        (0, [0.5], SZ),  # not an int: refused, not truncated
    ],
)
def test_bad_columns_refuse_the_call_before_reading(client, reg, off, size):
    c, a, b, ra, rb, keys, data = client
    a[:] = 0
    with pytest.raises(E.InvalidParams):
        c.get_into_regions(keys[:1], [ra, rb], reg, off, size)
    assert not a.any()


def test_unregistered_region_is_refused(client):
    c, a, b, ra, rb, keys, data = client
    scratch = np.zeros(SZ, np.uint8)
    r = c.register_buffer(scratch)
    c.unregister_buffer(r)
    with pytest.raises(E.NotRegistered):
        c.get_into_regions(keys[:1], [r], 0, [0], SZ)


def test_by_parts_lands_the_bytes_of_the_joined_names(client):
    """By parts (``prefix + key + suffix``, key-major: HiCache's K and V objects of a page):
    the master joins the names (GetPartsReq) and the bytes that land, per name, are exactly
    those of the same get by joined names; a missing name fails alone under its own name."""
    c, a, b, ra, rb, keys, data = client
    pages, sufs = [str(i) for i in range(9)], ["/k", "/v"]
    names = [f"pp/{p}{s}" for p in pages for s in sufs]
    blobs = [np.full(SZ, 10 + j, np.uint8) for j in range(len(names))]
    assert c.put(names, [x.tobytes() for x in blobs]).ok
    off = ((5 * np.arange(len(names))) % 64 * SZ).astype(np.int64)  # scattered, in a only
    a[:] = 0
    got = c.get_into_regions(pages, [ra], 0, off, SZ, prefix="pp/", suffixes=sufs)
    assert list(got) == [SZ] * len(names)
    parts = a.copy()
    for j in range(len(names)):
        assert (a[off[j] : off[j] + SZ] == blobs[j]).all(), names[j]
    a[:] = 0
    assert list(c.get_into_regions(names, [ra], 0, off, SZ)) == [SZ] * len(names)
    assert (a == parts).all()
    # A page absent: its two names fail, named as joined, the rest land.
    got = c.get_into_regions(["1", "nope", "2"], [ra], 0, off[:6], SZ, prefix="pp/", suffixes=sufs)
    assert [type(r) for r in got] == [int, int, E.ObjectNotFound, E.ObjectNotFound, int, int]
    assert "pp/nope/k" in str(got[2]) and "pp/nope/v" in str(got[3])


def test_by_parts_refused_parts_fail_per_name_not_the_call(client):
    """Parts the client refuses (a joined name past the key limit, NUL in a suffix) are never
    sent by parts: the names are built and each bad one is its own InvalidKey."""
    c, a, b, ra, rb, keys, data = client
    off = np.arange(2, dtype=np.int64) * SZ
    got = c.get_into_regions(["0", "x" * 2000], [ra], 0, off, SZ, prefix="cols-", suffixes=[""])
    assert got[0] == SZ and isinstance(got[1], E.InvalidKey)
    got = c.get_into_regions(["0"], [ra], 0, off, SZ, prefix="cols-", suffixes=["", "\0"])
    assert got[0] == SZ and isinstance(got[1], E.InvalidKey)
