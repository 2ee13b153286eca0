"""The segment allocator against a brute-force model: best fit, coalescing, canonical state."""

from __future__ import annotations

import random

import pytest

from kvmesh.store.master.allocator import AllocatorError, SegmentAllocator, SortedInts


def test_sorted_ints_matches_a_sorted_list() -> None:
    rng = random.Random(7)
    s = SortedInts()
    model: list[int] = []
    for _ in range(6000):
        x = rng.randrange(3000)
        if x in model:
            s.remove(x)
            model.remove(x)
        else:
            s.add(x)
            model.append(x)
            model.sort()
        q = rng.randrange(5100)
        want = next((v for v in model if v >= q), None)
        assert s.ceil(q) == want
        assert len(s) == len(model)
    assert list(s) == model
    assert s.last() == (model[-1] if model else None)
    with pytest.raises(KeyError):
        s.remove(10**9)


def test_sorted_ints_splits_and_merges_blocks() -> None:
    s = SortedInts()
    for x in range(5000):  # appends: blocks split at 2 * load
        s.add(x * 2)
    assert len(s._lists) > 4 and list(s) == [x * 2 for x in range(5000)]
    for x in range(0, 10000, 2):
        if x % 64:
            s.remove(x)  # thin every block out: small blocks merge into their successor
    assert list(s) == list(range(0, 10000, 64))
    assert all(b for b in s._lists) and s._maxes == [b[-1] for b in s._lists]
    assert s.ceil(65) == 128 and s.ceil(10**6) is None and 64 in s and 66 not in s


def _free_runs(used: bytearray, align: int) -> list[tuple[int, int]]:
    """Maximal free runs of the model (one flag per ``align`` unit)."""
    runs = []
    i = 0
    n = len(used)
    while i < n:
        if used[i]:
            i += 1
            continue
        j = i
        while j < n and not used[j]:
            j += 1
        runs.append((i * align, j * align))
        i = j
    return runs


@pytest.mark.parametrize("seed", range(3))
def test_allocator_is_best_fit_and_coalesces(seed: int) -> None:
    rng = random.Random(seed)
    align = 64
    size = 64 * 512
    a = SegmentAllocator(size, align)
    used = bytearray(size // align)
    live: list[tuple[int, int]] = []
    for _ in range(1500):
        if live and rng.random() < 0.45:
            off, ln = live.pop(rng.randrange(len(live)))
            a.free(off, ln)
            for u in range(off // align, (off + a.rounded(ln)) // align):
                used[u] = 0
        else:
            ln = rng.choice((1, 64, 65, 200, 640, 3000))
            n = a.rounded(ln)
            runs = _free_runs(used, align)
            fitting = [(e - s, s) for s, e in runs if e - s >= n]
            off = a.alloc(ln)
            if not fitting:
                assert off == -1
                continue
            assert off == min(fitting)[1], "not the smallest fitting extent at the lowest offset"
            for u in range(off // align, (off + n) // align):
                assert not used[u]
                used[u] = 1
            live.append((off, ln))
        assert a.free_extents() == _free_runs(used, align)
        assert a.free_bytes == sum(e - s for s, e in a.free_extents())
        assert a.largest() == max((e - s for s, e in a.free_extents()), default=0)


def test_state_is_canonical_for_snapshots() -> None:
    """An allocator rebuilt from its free extents allocates exactly like the original."""
    rng = random.Random(3)
    a = SegmentAllocator(1 << 20, 64)
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.5:
            off, ln = live.pop(rng.randrange(len(live)))
            a.free(off, ln)
        else:
            ln = rng.randrange(1, 9000)
            off = a.alloc(ln)
            if off >= 0:
                live.append((off, ln))
    b = SegmentAllocator(1 << 20, 64, free=a.free_extents())
    for _ in range(500):
        ln = rng.randrange(1, 9000)
        assert a.alloc(ln) == b.alloc(ln)


def test_double_free_and_bad_ranges_are_refused() -> None:
    a = SegmentAllocator(4096, 64)
    x = a.alloc(100)
    y = a.alloc(100)
    a.free(x, 100)
    with pytest.raises(AllocatorError):
        a.free(x, 100)  # touches the free extent it created
    with pytest.raises(AllocatorError):
        a.free(4096, 64)
    with pytest.raises(AllocatorError):
        a.free(3, 64)  # unaligned
    a.free(y, 100)
    assert a.free_extents() == [(0, 4096)]
    assert a.used == 0


def test_alloc_rejects_non_positive_lengths() -> None:
    a = SegmentAllocator(4096)
    with pytest.raises(ValueError):
        a.alloc(0)
    with pytest.raises(ValueError):
        SegmentAllocator(4096, align=48)
