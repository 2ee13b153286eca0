"""kvmesh.transfer.nixl.plan: how a NIXL request becomes descriptors (pure numpy, no NIXL).

Runs in CPU-only CI without NIXL installed: nothing here loads NIXL, and
``test_planning_never_imports_nixl`` checks that in a process where NIXL cannot be imported.
Every plan is compared with a plain-Python reference on random requests.
"""

from __future__ import annotations

import functools
import operator
import subprocess
import sys

import numpy as np
import pytest

from kvmesh.transfer.errors import InvalidArgument, InvalidLength, OutOfBounds
from kvmesh.transfer.nixl.plan import descriptor_table, granule_table, plan_request

MiB = 1 << 20


def _reference(lo, ro, ln, lsize, rsize, max_rows, max_exp):
    """(prepared, granule, [(local idx, remote idx)...]) computed the obvious way."""
    n = len(ln)
    acc = functools.reduce(operator.or_, list(lo) + list(ro) + list(ln))
    g = acc & -acc
    if lsize // g > max_rows or rsize // g > max_rows:
        return False, 0, None
    rows = [(a // g + k, b // g + k) for a, b, c in zip(lo, ro, ln) for k in range(c // g)]
    if any(c != g for c in ln) and len(rows) > max(max_exp * n, n + 64):
        return False, 0, None
    return True, g, rows


def _random_request(rng, n, granule, size):
    slots = size // granule
    lo = rng.choice(slots - 8, n, replace=False) * granule
    ro = rng.choice(slots - 8, n, replace=False) * granule
    ln = rng.integers(1, 5, n) * granule
    return lo.tolist(), ro.tolist(), ln.tolist()


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 33, 300])
@pytest.mark.parametrize("uniform", [True, False])
def test_plans_match_the_reference(n, uniform):
    rng = np.random.default_rng(n * 2 + uniform)
    size = 64 * MiB
    for granule in (4096, 65536, 1 << 6):
        lo, ro, ln = _random_request(rng, n, granule, size)
        if uniform:
            ln = [granule] * n
        for max_rows in (1 << 20, 1 << 12):
            want = _reference(lo, ro, ln, size, size, max_rows, 16)
            for arrays in (False, True):
                args = (
                    (np.array(lo, np.uint64), np.array(ro, np.uint64), np.array(ln, np.uint64))
                    if arrays
                    else (lo, ro, ln)
                )
                plan = plan_request(*args, size, size, max_table_rows=max_rows)
                assert plan.nbytes == sum(ln)
                assert plan.prepared == want[0], (granule, max_rows, plan)
                if plan.prepared:
                    assert plan.granule == want[1]
                    assert plan.local_idx.dtype == np.int32 == plan.remote_idx.dtype
                    got = list(zip(plan.local_idx.tolist(), plan.remote_idx.tolist()))
                    assert got == want[2]
                    assert plan.count == len(got)
                else:
                    assert plan.lo.tolist() == lo and plan.ro.tolist() == ro
                    assert plan.ln.tolist() == ln and plan.count == n


def test_granule_and_fallbacks():
    size = 16 * MiB
    # uniform 64 KiB pages: one index per page
    p = plan_request([0, 5 * 65536], [65536, 0], [65536, 65536], size, size)
    assert p.prepared and p.granule == 65536
    assert p.local_idx.tolist() == [0, 5] and p.remote_idx.tolist() == [1, 0]
    # mixed lengths on a common 4 KiB granule: expanded into granules
    p = plan_request([0, 8192], [4096, 65536], [4096, 12288], size, size)
    assert p.prepared and p.granule == 4096 and p.count == 4
    assert p.local_idx.tolist() == [0, 2, 3, 4] and p.remote_idx.tolist() == [1, 16, 17, 18]
    # an odd offset: granule 1 would need a row per byte -> explicit descriptors
    p = plan_request([1, 1000], [77, 5003], [333, 2049], size, size)
    assert not p.prepared and p.count == 2 and p.nbytes == 333 + 2049
    # one long piece next to small ones: expanding it would cost too many indices
    p = plan_request([0, 4096], [0, 4096], [4096, 4 * MiB], size, size, max_expansion=16)
    assert not p.prepared
    p = plan_request([0, 4096], [0, 4096], [4096, 4 * MiB], size, size, max_expansion=1 << 20)
    assert p.prepared and p.count == 1 + 1024
    # the table bound applies to either region
    p = plan_request([0], [0], [4096], 4096 * 300, size, max_table_rows=256)
    assert not p.prepared


def test_trusted_arrays_are_not_copied_or_checked():
    lo = np.arange(0, 64 * 4096, 4096, dtype=np.int64)
    ln = np.full(64, 4096, np.uint64)
    p = plan_request(lo, lo, ln, MiB, MiB, trusted=True)
    assert p.prepared and np.shares_memory(p.lo, lo) and p.ln is ln
    assert p.local_idx.tolist() == list(range(64))
    with pytest.raises(InvalidLength):
        plan_request(lo[:3], lo, ln, MiB, MiB, trusted=True)
    with pytest.raises(InvalidLength):
        plan_request([], [], [], MiB, MiB, trusted=True)


def _array(values):
    if all(isinstance(v, int) for v in values):
        return np.array(values, np.uint64 if max(values) >= 1 << 63 else np.int64)
    return np.array(values)


@pytest.mark.parametrize("n", [1, 20])  # the Python-int path and the numpy path
def test_bad_requests(n):
    size = MiB

    def req(lo, ro, ln):
        return ([0] * (n - 1) + [lo], [0] * (n - 1) + [ro], [16] * (n - 1) + [ln])

    for args, exc in (
        (req(size - 10, 0, 11), OutOfBounds),
        (req(0, size, 1), OutOfBounds),
        (req(0, 2**64 - 1, 2), OutOfBounds),  # would wrap around
        (req(0, 2**63 - 1, 2), OutOfBounds),  # the end would wrap an int64
        (req(0, 0, 0), InvalidLength),
        (req(0, 0, -5), InvalidLength),
        (req(-1, 0, 5), OutOfBounds),
        (req(0.5, 0, 5), InvalidArgument),
    ):
        with pytest.raises(exc):
            plan_request(*args, size, size)
        with pytest.raises(exc):  # as numpy arrays of the caller's dtype too
            plan_request(*(_array(a) for a in args), size, size)
    with pytest.raises(InvalidLength):
        plan_request([], [], [], size, size)
    with pytest.raises(InvalidArgument):
        plan_request([0, 1], [0], [1], size, size)
    with pytest.raises(InvalidArgument):
        plan_request(np.zeros((2, 2), np.int64), [0, 0], [1, 1], size, size)
    p = plan_request(4096, 0, 4096, size, size)  # plain integers: one piece
    assert p.prepared and p.count == 1 and p.local_idx.tolist() == [1]


def test_tables():
    t = descriptor_table(np.array([0, 100], np.uint64), np.array([10, 20], np.uint64), 1000, 3)
    assert t.dtype == np.uint64 and t.tolist() == [[1000, 10, 3], [1100, 20, 3]]
    g = granule_table(1 << 30, 4096 * 3 + 100, 4096, 0)  # partial last granule: no row
    assert g.tolist() == [
        [1 << 30, 4096, 0],
        [(1 << 30) + 4096, 4096, 0],
        [(1 << 30) + 8192, 4096, 0],
    ]


def test_planning_never_imports_nixl():
    """Planning works in a process where every NIXL package fails to import."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('nixl', 'nixl_cu12', 'nixl_cu13'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from kvmesh.transfer.nixl.plan import plan_request\n"
        "from kvmesh.transfer import nixl\n"
        "p = plan_request([0, 65536], [0, 65536], [65536, 65536], 1 << 20, 1 << 20)\n"
        "assert p.prepared and p.local_idx.tolist() == [0, 1]\n"
        "assert not nixl.available() and 'blocked' in nixl.unavailable_reason()\n"
        "assert not [m for m in sys.modules if m.split('.')[0].startswith('nixl')]\n"
        "print('OK')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK"
