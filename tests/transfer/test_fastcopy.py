"""The copy primitive used by the local and shared-memory transports."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvmesh.transfer import fastcopy


@pytest.mark.parametrize("n", [1, 7, 8, 2047, 2048, 4096, 4100, 65536 + 3, 1 << 20])
@pytest.mark.parametrize("shift", [0, 1, 8])
def test_copy_is_exact_for_any_size_and_alignment(n, shift):
    rng = np.random.default_rng(n + shift)
    src = rng.integers(0, 256, n + 64, dtype=np.uint8)
    dst = np.zeros(n + 64, dtype=np.uint8)
    fastcopy.copy(dst.ctypes.data + shift, src.ctypes.data + 8, n)
    assert (dst[shift : shift + n] == src[8 : 8 + n]).all()
    assert not dst[:shift].any() and not dst[shift + n :].any()


def test_copy_ranges_many_scattered_ranges():
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 1 << 22, dtype=np.uint8)
    dst = np.zeros(1 << 22, dtype=np.uint8)
    page = 16 << 10
    so = rng.permutation(256)[:200].astype(np.uint64) * page
    do = rng.permutation(256)[:200].astype(np.uint64) * page
    fastcopy.copy_ranges(dst.ctypes.data, do, src.ctypes.data, so, np.full(200, page, np.uint64))
    for s, d in zip(so.tolist(), do.tolist()):
        assert (dst[d : d + page] == src[s : s + page]).all()
    # Unaligned and tiny ranges mixed in take the memmove path.
    lo = np.array([1, 100, 5000, 9000, 20000, 40000], np.uint64)
    ln = np.array([3, 4093, 2048, 1, 8, 3000], np.uint64)
    dst[:] = 0
    fastcopy.copy_ranges(dst.ctypes.data, lo, src.ctypes.data, lo + np.uint64(7), ln)
    for o, n in zip(lo.tolist(), ln.tolist()):
        assert (dst[o : o + n] == src[o + 7 : o + 7 + n]).all()


def test_copy_ranges_many_small_ranges_exact():
    # Thousands of sub-2 KiB ranges (HiCache's layer_first pages) take one C-level map of
    # memmoves: every range lands exactly, nothing outside them is written.
    rng = np.random.default_rng(5)
    src = rng.integers(1, 256, 1 << 22, dtype=np.uint8)
    dst = np.zeros(1 << 22, dtype=np.uint8)
    n, z = 1500, 1000
    so = rng.permutation(4096)[:n].astype(np.uint64) * np.uint64(1024)
    do = rng.permutation(4096)[:n].astype(np.uint64) * np.uint64(1024)
    ln = np.full(n, z, np.uint64)
    fastcopy.copy_ranges(dst.ctypes.data, do, src.ctypes.data, so, ln)
    want = np.zeros_like(dst)
    for s, d in zip(so.tolist(), do.tolist()):
        want[d : d + z] = src[s : s + z]
    assert (dst == want).all()


def test_long_copies_call_check_and_can_abort():
    src = np.ones(64 << 20, np.uint8)
    dst = np.zeros_like(src)
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("stop")

    offs = np.arange(64, dtype=np.uint64) * np.uint64(1 << 20)
    with pytest.raises(RuntimeError):
        fastcopy.copy_ranges(
            dst.ctypes.data, offs, src.ctypes.data, offs, np.full(64, 1 << 20, np.uint64), check
        )
    assert len(calls) == 2
    assert 0 < int(dst.sum()) < dst.size  # stopped part-way, not before or after


def _choice(env: str) -> dict:
    code = (
        "import json; from kvmesh.transfer import fastcopy; c = fastcopy.choice(); "
        "print(json.dumps({'kernel': c.kernel, 'label': c.label, 'probe_ms': c.probe_ms, "
        "'gbps': c.medians(), 'dcopy_live': fastcopy._dcopy is not None}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "KVMESH_COPY": env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_kernel_can_be_forced_either_way_and_is_then_not_measured():
    found = fastcopy.find_dcopy()[0] is not None
    mm = _choice("memmove")
    assert mm["kernel"] == "memmove" and mm["label"] == "memmove (KVMESH_COPY)"
    assert mm["probe_ms"] is None and mm["gbps"] == {} and not mm["dcopy_live"]
    dc = _choice(" DCOPY ")
    assert dc["kernel"] == ("dcopy" if found else "memmove") and dc["probe_ms"] is None
    assert dc["dcopy_live"] is found  # the copies really go through the forced kernel
    if found:
        assert dc["label"].startswith("openblas dcopy (") and "KVMESH_COPY" in dc["label"]


def test_auto_measures_every_shape_and_both_kernels():
    c = _choice("auto")
    if fastcopy.find_dcopy()[0] is None:
        pytest.skip("no bit-exact OpenBLAS dcopy: nothing to choose between")
    assert c["probe_ms"] is not None and c["probe_ms"] > 0
    assert set(c["gbps"]) == {label for label, _ in fastcopy.PROBE_SHAPES}
    for by in c["gbps"].values():
        assert set(by) == {"memmove", "dcopy"} and all(v > 0 for v in by.values())
    assert c["kernel"] in fastcopy.KERNELS and c["dcopy_live"] is (c["kernel"] == "dcopy")
    assert "measured: dcopy" in c["label"]


def test_a_bad_override_is_refused():
    with pytest.raises(ValueError, match="KVMESH_COPY"):
        fastcopy.forced_kernel("fast")
    assert fastcopy.forced_kernel("") is None and fastcopy.forced_kernel(" Auto ") is None


def _shapes(**ratios_by_shape):
    """Probe samples with memmove at 10 GB/s and dcopy at 10 x the given per-round ratios."""
    return {
        shape: {"memmove": [10.0] * len(rs), "dcopy": [10.0 * r for r in rs]}
        for shape, rs in ratios_by_shape.items()
    }


def test_decide_picks_dcopy_only_when_clearly_faster():
    # The first AMD VM: rep movsb 3-4x slower from 4 KiB-page sources (docs/transfer.md).
    amd = _shapes(p128=[3.5, 3.2, 3.9], p512=[3.0, 3.1, 2.9], run=[1.1, 1.0, 1.2])
    assert fastcopy.decide(amd)[0] == "dcopy"
    # Intel with FSRM: memmove faster everywhere.
    intel = _shapes(p128=[0.8, 0.85, 0.8], p512=[0.7, 0.72, 0.75], run=[0.55, 0.5, 0.6])
    assert fastcopy.decide(intel)[0] == "memmove"
    # This EPYC: within +-15 % either way per shape -> a near tie keeps the default.
    tie = _shapes(p128=[0.82, 0.85, 0.8], p512=[0.92, 0.9, 0.95], run=[1.03, 1.05, 1.0])
    kernel, why = fastcopy.decide(tie)
    assert kernel == fastcopy.DEFAULT_KERNEL == "memmove" and "near tie" in why
    # ... also when the tie leans to dcopy: a few per cent do not switch kernels.
    lean = _shapes(p128=[1.1, 1.08, 1.12], p512=[1.05, 1.06, 1.04], run=[1.07, 1.1, 1.05])
    assert fastcopy.decide(lean)[0] == "memmove"
    # Just over / under the margin on every shape.
    m = fastcopy.TIE_MARGIN
    assert fastcopy.decide(_shapes(a=[m * 1.01] * 3, b=[m * 1.01] * 3))[0] == "dcopy"
    assert fastcopy.decide(_shapes(a=[m * 0.99] * 3, b=[m * 0.99] * 3))[0] == "memmove"


def test_decide_resists_noise():
    # One round where a neighbour stalled memmove (dcopy looks 5x faster) does not flip a tie:
    # medians of paired rounds, not means.
    noisy = _shapes(p128=[1.0, 5.0, 0.98, 1.02, 1.0], p512=[1.01, 0.97, 6.0, 1.0, 0.99])
    assert fastcopy.decide(noisy)[0] == "memmove"
    # Load that changes between rounds moves both kernels of a round alike: still a tie.
    drift = {
        "p128": {"memmove": [20.0, 10.0, 5.0], "dcopy": [21.0, 10.5, 5.1]},
        "p512": {"memmove": [4.0, 16.0, 8.0], "dcopy": [4.1, 16.5, 8.1]},
    }
    assert fastcopy.decide(drift)[0] == "memmove"
    # Missing or unusable figures keep the default rather than guessing.
    assert fastcopy.decide({})[0] == "memmove"
    assert fastcopy.decide({"p128": {"memmove": [10.0], "dcopy": []}})[0] == "memmove"
    assert fastcopy.decide({"p128": {"memmove": [0.0], "dcopy": [30.0]}})[0] == "memmove"


def test_copy_ranges_exact_with_either_kernel(monkeypatch):
    fn, _ = fastcopy.find_dcopy()
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, 1 << 21, dtype=np.uint8)
    page = 64 << 10
    so = rng.permutation(32)[:20].astype(np.uint64) * np.uint64(page)
    do = rng.permutation(32)[:20].astype(np.uint64) * np.uint64(page)
    fastcopy.choice()  # selected first, so the kernel set below is the one that copies
    for kernel in (None, fn):
        monkeypatch.setattr(fastcopy, "_dcopy", kernel)
        dst = np.zeros(1 << 21, dtype=np.uint8)
        fastcopy.copy_ranges(dst.ctypes.data, do, src.ctypes.data, so, np.full(20, page, np.uint64))
        for s, d in zip(so.tolist(), do.tolist()):
            assert (dst[d : d + page] == src[s : s + page]).all()


def test_copy_slots_rule():
    assert fastcopy.copy_slots("", 2) == 2
    assert fastcopy.copy_slots("", 0) == 1
    assert fastcopy.copy_slots(" 3 ", 2) == 3
    assert fastcopy.copy_slots("0", 8) == 0  # off
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(ValueError, match="KVMESH_COPY_THREADS"):
            fastcopy.copy_slots(bad, 2)


@pytest.fixture
def two_slots(monkeypatch):
    gate = fastcopy._Gate(2)
    monkeypatch.setattr(fastcopy, "_gate", gate)
    monkeypatch.setattr(fastcopy, "COPY_SLOTS", 2)
    return gate


def test_small_copies_never_wait_and_bulk_ones_wait_for_a_slot(two_slots):
    import threading

    a, b = fastcopy.bulk_slot(1 << 20), fastcopy.bulk_slot(1 << 20)  # both slots taken
    assert fastcopy.bulk_busy()
    small = fastcopy.bulk_slot(fastcopy.GATE_MIN_BYTES - 1)  # a store get of a few pages
    with small:
        pass
    got = threading.Event()

    def bulk():
        with fastcopy.bulk_slot(4 << 20):
            got.set()

    t = threading.Thread(target=bulk)
    t.start()
    assert not got.wait(0.2), "a third bulk copy ran while both slots were held"
    a.__exit__(None, None, None)
    assert got.wait(5), "a released slot was not taken"
    t.join(5)
    b.__exit__(None, None, None)
    st = fastcopy.gate_stats()
    assert st["held"] == 0 and st["taken"] == 3 and st["waited"] == 1


def test_concurrent_bulk_transfers_copy_at_most_one_per_slot(make_engine, two_slots, monkeypatch):
    # Six threads each moving 4 MiB in 8 region pairs through the same-process (local) path:
    # copies overlap at most two at a time (and do overlap: the gate is not a global lock).
    import threading
    import time

    from kvmesh.transfer import Op
    from kvmesh.transfer.transports import local as local_mod

    owner, client = make_engine(), make_engine()
    real = local_mod.copy_ranges
    active, peak, lock = [0], [0], threading.Lock()

    def watched(*a, **k):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.002)  # leaves the GIL, as the real copy does: threads would pile up here
        try:
            real(*a, **k)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(local_mod, "copy_ranges", watched)
    size = 512 << 10
    srcs = [np.full(size, i, np.uint8) for i in range(8)]
    dsts = [np.zeros(size, np.uint8) for _ in range(8)]
    for x in srcs:
        client.register(x)
    for i, x in enumerate(dsts):
        owner.register(x, name=f"slot-{i}")
    local = [x.ctypes.data for x in srcs]
    remote = [x.ctypes.data for x in dsts]
    errors = []

    def worker():
        try:
            for _ in range(5):
                client.transfer_by_address(Op.WRITE, owner.address, local, remote, [size] * 8)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all((d == i).all() for i, d in enumerate(dsts))
    assert peak[0] == 2, f"{peak[0]} bulk copies ran at once with two slots"
    st = fastcopy.gate_stats()
    assert st["waited"] > 0
    assert st["held"] == 0 and not fastcopy.bulk_busy(), "a slot count drifted"
