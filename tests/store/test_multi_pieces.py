"""The batch form of the multi-buffer resolution (``StoreClient._flat_pieces``): HiCache's
layer_first pages name 32-64 raw address ranges per object, thousands per batch, resolved
with one vectorised region lookup instead of one per range. It must give exactly what the
range-by-range path gives, and leave every batch it cannot vouch for (an address outside
registered memory, a range past a region's end, a size that is not a positive int, a buffer
object) to that path, which reports the bad object alone."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvmesh.store import errors as E
from kvmesh.store.client import StoreClient


def _slow(c: StoreClient, buffers: list[list], sizes: list[list]) -> tuple[list, list]:
    where = c._resolver()
    bufs, totals = [], []
    for b, z in zip(buffers, sizes):
        try:
            bufs.append(c._pieces(list(b), list(z), where))
            totals.append(sum(z))
        except E.StoreError as e:
            bufs.append(e)
            totals.append(0)
    return bufs, totals


@pytest.fixture(scope="module")
def client():
    with StoreClient(segment_size=8 << 20) as c:
        a = np.zeros(1 << 20, np.uint8)
        b = np.zeros(1 << 19, np.uint8)
        c.register_buffer(a)
        c.register_buffer(b)
        yield c, a, b


def test_batch_resolution_equals_range_by_range(client):
    c, a, b = client
    rng = random.Random(3)
    for _ in range(30):
        buffers, sizes = [], []
        for _ in range(rng.randint(1, 12)):
            arr = rng.choice([a, b])
            k = rng.randint(1, 40)
            z = [rng.randint(1, 4096) for _ in range(k)]
            p = [arr.ctypes.data + rng.randint(0, arr.nbytes - n) for n in z]
            buffers.append(p)
            sizes.append(z)
        flat = c._flat_pieces(buffers, sizes)
        assert flat is not None
        assert flat == _slow(c, buffers, sizes)
        # the regions are the registered ones themselves (not copies)
        assert {id(r) for obj in flat[0] for r, _, _ in obj} <= {id(r) for r in c._buffers.values()}


def test_batches_it_cannot_vouch_for_take_the_range_by_range_path(client):
    c, a, b = client
    good = [a.ctypes.data, a.ctypes.data + 100]
    cases = [
        [[a.ctypes.data + a.nbytes - 10]],  # runs past the region's end
        [[1 << 40]],  # not registered
        [[-1]],  # negative
        [[a]],  # a buffer object: the general path
        [[True]],  # a bool is not an address
        [[]],  # no range
    ]
    for bad in cases:
        buffers = [good, *bad]
        sizes = [[64, 64], [64] * len(bad[0])]
        assert c._flat_pieces(buffers, sizes) is None
    assert c._flat_pieces([good], [[64, 0]]) is None
    assert c._flat_pieces([good], [[64, 64.0]]) is None
    assert c._flat_pieces([good], [[64]]) is None  # one size per buffer
    # through the public call: the good object is read, the bad one refused alone
    key = "mp/obj"
    a[:128] = np.arange(128, dtype=np.uint8)
    assert c.put_from([key], [a.ctypes.data], 0, [128]).ok
    b[:256] = 0
    res = c.get_into_multi(
        [key, key], [[b.ctypes.data, b.ctypes.data + 64], [1 << 40]], [[64, 64], [128]]
    )
    assert res[0] == 128 and isinstance(res[1], E.NotRegistered)
    assert (b[:128] == np.arange(128, dtype=np.uint8)).all()


def test_a_batch_lookup_without_the_range_end_check_is_caught(client, monkeypatch):
    """Planted: the batch path looks up each range's first byte only, so a range running past
    its region's end is vouched for (and would be read or written past the registration)."""
    c, a, _ = client
    real = c.engine.find_regions

    def first_byte_only(ptrs, lengths):
        return real(ptrs, np.ones(len(ptrs), np.uint64))

    monkeypatch.setattr(c.engine, "find_regions", first_byte_only)
    past_end = [[a.ctypes.data + a.nbytes - 10]]
    assert c._flat_pieces(past_end, [[64]]) is not None  # what the refusal test above rejects
