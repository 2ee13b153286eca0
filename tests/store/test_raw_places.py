"""Batches named by raw addresses (HiCache's one range per page): ``get_into_raw`` /
``put_from_raw`` and ``get_into`` / ``put_from`` with a list of addresses resolve every
address in one vectorised lookup (``Buffers._raw_places``) and must answer exactly what the
per-key path answers: the bytes, over one registration or several, and per key the error of
an address outside registered memory, a range past a registration's end, a bad size."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.store import errors as E
from kvmesh.store.client import StoreClient

SZ = 1000


@pytest.fixture(scope="module")
def client():
    with StoreClient(segment_size=8 << 20) as c:
        a = np.zeros(64 * SZ, np.uint8)
        b = np.zeros(64 * SZ, np.uint8)
        c.register_buffer(a)
        c.register_buffer(b)
        yield c, a, b


def _addresses(a, b, n):
    """Key i's place: even keys in ``a``, odd ones in ``b``, out of order."""
    return np.array(
        [(a if i % 2 == 0 else b).ctypes.data + ((7 * i) % 64) * SZ for i in range(n)], np.int64
    )


def _check(a, b, ptrs):
    for i, p in enumerate(ptrs.tolist()):
        arr, base = (a, a.ctypes.data) if i % 2 == 0 else (b, b.ctypes.data)
        assert (arr[p - base : p - base + SZ] == i + 1).all(), i


def test_raw_columns_over_two_registrations_round_trip(client):
    c, a, b = client
    n = 16
    keys = [f"raw-two-{i}" for i in range(n)]
    ptrs = _addresses(a, b, n)
    for i, p in enumerate(ptrs.tolist()):
        arr, base = (a, a.ctypes.data) if i % 2 == 0 else (b, b.ctypes.data)
        arr[p - base : p - base + SZ] = i + 1
    places = c._raw_places(ptrs, 0, SZ, n)
    assert places is not None and places.reg is not None  # the several-region form
    assert c.put_from_raw(keys, ptrs, np.full(n, SZ)).ok
    a[:] = 0
    b[:] = 0
    got = c.get_into_raw(keys, ptrs, np.full(n, SZ))
    assert list(got) == [SZ] * n and got.transports
    _check(a, b, ptrs)
    # The list form of get_into / put_from takes the same path, with the same answers.
    a[:] = 0
    b[:] = 0
    assert list(c.get_into(keys, ptrs.tolist(), 0, [SZ] * n)) == [SZ] * n
    _check(a, b, ptrs)
    assert isinstance(c.put_from(keys, ptrs.tolist(), 0, [SZ] * n)[0], E.ObjectExists)


def test_raw_columns_in_one_registration_take_the_one_region_form(client):
    c, a, _ = client
    n = 8
    keys = [f"raw-one-{i}" for i in range(n)]
    ptrs = a.ctypes.data + np.arange(n, dtype=np.int64) * SZ
    a[: n * SZ] = np.repeat(np.arange(1, n + 1, dtype=np.uint8), SZ)
    places = c._raw_places(ptrs, 0, SZ, n)
    assert places is not None and places.reg is None
    assert c.put_from_raw(keys, ptrs, SZ).ok
    a[:] = 0
    assert list(c.get_into_raw(keys, ptrs)) == [SZ] * n  # capacity: to the registration's end
    assert (a[: n * SZ] == np.repeat(np.arange(1, n + 1, dtype=np.uint8), SZ)).all()


def test_a_bad_address_or_size_fails_its_key_alone(client):
    c, a, b = client
    n = 6
    keys = [f"raw-bad-{i}" for i in range(n)]
    ptrs = _addresses(a, b, n)
    assert c.put_from_raw(keys, ptrs, SZ).ok
    bad = ptrs.copy()
    bad[2] = 12345  # not registered memory
    bad[4] = a.ctypes.data + a.nbytes - SZ // 2  # runs past the registration's end
    for res in (c.get_into_raw(keys, bad, SZ), c.get_into(keys, bad.tolist(), 0, [SZ] * n)):
        assert isinstance(res[2], E.NotRegistered) and isinstance(res[4], E.NotRegistered)
        assert [res[i] for i in (0, 1, 3, 5)] == [SZ] * 4
    res = c.put_from_raw([f"raw-bad-new-{i}" for i in range(n)], bad, SZ)
    assert isinstance(res[2], E.NotRegistered) and isinstance(res[4], E.NotRegistered)
    assert [res[i] for i in (0, 1, 3, 5)] == [None] * 4
    sizes = [SZ] * n
    sizes[1] = 0
    res = c.put_from_raw([f"raw-bad-size-{i}" for i in range(n)], ptrs, sizes)
    assert isinstance(res[1], E.InvalidParams) and res[0] is None
    # A destination too small: that key is refused (BufferOverflow), the others read.
    caps = np.full(n, SZ)
    caps[3] = SZ - 1
    res = c.get_into_raw(keys, ptrs, caps)
    assert isinstance(res[3], E.BufferOverflow) and res[0] == SZ


def test_a_group_that_fails_fails_only_its_keys(client, monkeypatch):
    """Over several registrations one engine batch is grouped per region: the keys of a
    group that fails are TransferFailed, the others read (the several-region fast path)."""
    c, a, b = client
    n = 8
    keys = [f"raw-grp-{i}" for i in range(n)]
    ptrs = _addresses(a, b, n)
    assert c.put_from_raw(keys, ptrs, SZ).ok
    real = c._move_arrays

    def fail_b(op, owner, regions, reg, *rest):
        f, t = real(op, owner, regions, reg, *rest)
        lost = owner[np.asarray([regions[x] for x in reg.tolist()]) == c._region_of(b, 1)[0]]
        return np.union1d(f, lost), t

    monkeypatch.setattr(c, "_move_arrays", fail_b)
    res = c.get_into_raw(keys, ptrs, SZ)
    assert [type(r) for r in res[1::2]] == [E.TransferFailed] * (n // 2)
    assert list(res[0::2]) == [SZ] * (n // 2)
