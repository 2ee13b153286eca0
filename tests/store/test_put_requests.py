"""The batch put's fast paths against the general ones they stand in for: the engine requests
built from a compact PutStart answer (``_run_requests``) against those of the per-key loop
(``resp.copies()`` -> ``_copy_reqs`` -> ``StoreClient._move``'s columns), and the RPC split
without encoding the keys against the split key by key."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.store import client as C
from kvmesh.store import errors as E
from kvmesh.store import protocol as P
from kvmesh.store.client import replies as R
from kvmesh.store.client import writes as W
from kvmesh.store.types import ReplicaRun


class _Region:
    """Stands in for a MemoryRegion: the requests only carry it (compared by identity)."""


def _loop_requests(resp: P.PutStartResp, bufs: list, sizes: list[int]) -> tuple:
    """What ``_put_part``'s per-key loop hands ``_move``, in ``_move_arrays``' form."""
    copies = resp.copies()
    assert not W._malformed_copies(resp.codes, copies, resp.run, sizes)
    reqs = [r for j, b in enumerate(bufs) for rep in copies[j] for r in W._copy_reqs(j, b, rep)]
    regions: list = []
    segs: list = []
    cols = []
    for owner, region, lo, ep, name, ro, ln in reqs:
        if region not in regions:
            regions.append(region)
        if (name, ep) not in [(s[0], s[2]) for s in segs]:
            segs.append(next(s for s in resp.run.segs if (s[0], s[2]) == (name, ep)))
        x = regions.index(region)
        y = [(s[0], s[2]) for s in segs].index((name, ep))
        cols.append((owner, x, lo, y, ro, ln))
    return regions, segs, np.array(cols, np.int64)


def _fast_columns(arrays: tuple) -> tuple:
    owner, regions, reg, lo, segs, seg, ro, ln = arrays
    # segment indices name resp.run.segs; renumber them in order of first use, as _move does
    used: list[int] = []
    for y in seg.tolist():
        if y not in used:
            used.append(y)
    seg2 = np.array([used.index(y) for y in seg.tolist()], np.int64)
    return regions, [segs[y] for y in used], np.stack([owner, reg, lo, seg2, ro, ln], 1)


@pytest.mark.parametrize("nregions", [1, 3])
def test_run_requests_match_the_per_key_loop(nregions):
    rng = np.random.default_rng(5)
    n = 300
    segs = [("seg-a", "node-1", "127.0.0.1:1"), ("seg-b", "node-2", "127.0.0.1:2")]
    sizes = rng.integers(1, 1 << 20, n).tolist()
    where = rng.integers(0, len(segs), n).tolist()
    offsets = rng.integers(0, 1 << 40, n).tolist()
    run = ReplicaRun(segs, where, offsets, sizes)
    resp = P.PutStartResp(7, [0] * n, [], list(range(n)), 60_000, run)
    regions = [_Region() for _ in range(nregions)]
    bufs = [(regions[i % nregions], int(o)) for i, o in enumerate(rng.integers(0, 1 << 30, n))]
    arrays = W._run_requests(resp, bufs, sizes)
    assert arrays is not None
    want_regions, want_segs, want = _loop_requests(resp, bufs, sizes)
    got_regions, got_segs, got = _fast_columns(arrays)
    assert got_regions == want_regions and got_segs == want_segs
    np.testing.assert_array_equal(got, want)


def _answer(sizes, codes=None, where=None, lengths=None):
    n = len(sizes)
    run = ReplicaRun(
        [("s", "n", "127.0.0.1:1")],
        [0] * n if where is None else where,
        list(range(0, 100 * n, 100)),
        list(sizes) if lengths is None else lengths,
    )
    return P.PutStartResp(1, [0] * n if codes is None else codes, [], [1] * n, 0, run)


def test_run_requests_leave_every_other_answer_to_the_checked_loop():
    r = _Region()
    bufs, sizes = [(r, 0), (r, 100)], [10, 20]
    assert W._run_requests(_answer(sizes), bufs, sizes) is not None
    # a refused key, a key without a copy, a copy longer than its key, pieces, no run
    assert W._run_requests(_answer(sizes, codes=[0, 5], where=[0, -1]), bufs, sizes) is None
    assert W._run_requests(_answer(sizes, where=[0, -1]), bufs, sizes) is None
    assert W._run_requests(_answer(sizes, lengths=[10, 40]), bufs, sizes) is None
    assert W._run_requests(_answer(sizes), [(r, 0), [(r, 100, 20)]], sizes) is None
    plain = P.PutStartResp(1, [0, 0], [None, None], [1, 1], 0, None)
    assert W._run_requests(plain, bufs, sizes) is None


def _split_key_by_key(idx, keys):
    parts, cur, size = [], [], 0
    for i in idx:
        n = len(keys[i].encode())
        if cur and (len(cur) >= R.MAX_KEYS_PER_RPC or size + n > R.MAX_KEY_BYTES_PER_RPC):
            parts.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    return parts + ([cur] if cur else [])


@pytest.mark.parametrize(
    "keys",
    [
        [],
        ["k"],
        [f"key-{i}" for i in range(5000)],  # over the key count
        ["x" * 4000] * 200,  # over the key bytes (ASCII)
        ["\u00e9" * 2000] * 200,  # two bytes per character
        ["\U0001f600" * 1000] * 200,  # four bytes per character
        ["k" * 600] * 218 + ["\U0001f600" * 200],  # near the bound of the shortcut
    ],
)
def test_rpc_parts_split_as_the_key_by_key_count(keys):
    idx = list(range(len(keys)))
    assert R.rpc_parts(keys, idx, key_bytes=True) == _split_key_by_key(idx, keys)
    odd = idx[::2]
    assert R.rpc_parts(keys, odd, key_bytes=True) == _split_key_by_key(odd, keys)


class _Sized:
    def __init__(self, size: int) -> None:
        self.size = size


def test_one_region_vouches_only_for_ranges_inside_the_registration():
    """The columns a put from one buffer (and a get into one) take without a check per key:
    every range inside the registration, every offset and size an int (a put's sizes
    positive); anything else is left to the per-key loop, which names the refused key."""
    region = _Sized(1000)

    class _Client:
        @staticmethod
        def _region_of(buffer, length):
            if buffer == "unregistered":
                raise E.NotRegistered("no")
            return region, 100  # the buffer starts 100 bytes into its registration

    def one(buffer, offs, sizes, batch=True):
        n = len(offs) if batch else 1
        return C.StoreClient._one_region(_Client(), buffer, offs, sizes, n, batch)

    got = one("buf", [0, 400, 890], [10, 20, 10])  # columns, no tuple per key
    assert [got.at(i) for i in range(3)] == [(region, 100), (region, 500), (region, 990)]
    assert got.caps.tolist() == [10, 20, 10]
    got = one("buf", 890, 10, batch=False)  # one key: the same checks on ints
    assert got.at(0) == (region, 990) and list(got.caps) == [10]
    assert one("buf", 891, 10, batch=False) is None
    assert one("buf", 0, True, batch=False) is None
    assert one("buf", [0, 891], [10, 10]) is None  # ends 1 byte past the registration
    assert one("buf", [0, -1], [10, 10]) is None
    assert one("buf", [0, 10], [10, 0]) is None
    assert one("buf", [0, 10], [10, -5]) is None
    assert one("buf", [0, 10], [10, None]) is None
    assert one("buf", [0, 10], [10, True]) is None
    assert one("buf", [0, 1.0], [10, 10]) is None
    assert one("buf", [0, 10], [10, "10"]) is None
    assert one("buf", [0, 10], [10]) is None  # a size short
    assert one("unregistered", [0], [10]) is None
