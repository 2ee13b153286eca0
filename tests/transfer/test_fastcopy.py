"""The copy primitive used by the local and shared-memory transports."""

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


def _backend(env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", "from kvmesh.transfer import fastcopy; print(fastcopy.BACKEND)"],
        env={**os.environ, "KVMESH_COPY": env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_backend_can_be_forced_either_way():
    assert _backend("memmove").startswith("memmove (KVMESH_COPY)")
    forced = _backend("dcopy")
    found, _ = fastcopy.find_dcopy()
    assert forced.startswith("openblas dcopy" if found is not None else "memmove")
    assert fastcopy.BACKEND  # whichever backend this process found, it passed the exactness check


def test_kernel_selection_rule():
    # rep movsb (memmove) measured slow from 4 KiB-page sources on AMD only; on Intel it beat the
    # SIMD loop (docs/transfer.md, "Copies: which kernel").
    assert fastcopy.choose_kernel("", "GenuineIntel")[0] == "memmove"
    assert fastcopy.choose_kernel("auto", "AuthenticAMD")[0] == "dcopy"
    assert fastcopy.choose_kernel("", "HygonGenuine")[0] == "dcopy"
    assert fastcopy.choose_kernel("", "")[0] == "memmove"
    assert fastcopy.choose_kernel(" DCOPY ", "GenuineIntel") == ("dcopy", "KVMESH_COPY")
    assert fastcopy.choose_kernel("memmove", "AuthenticAMD") == ("memmove", "KVMESH_COPY")
    with pytest.raises(ValueError, match="KVMESH_COPY"):
        fastcopy.choose_kernel("fast", "GenuineIntel")
    # This process applied the rule to its own CPU.
    kernel, _ = fastcopy.choose_kernel(os.environ.get("KVMESH_COPY", ""), fastcopy.cpu_vendor())
    if kernel == "dcopy" and fastcopy.find_dcopy()[0] is not None:
        assert fastcopy.BACKEND.startswith("openblas dcopy")
    else:
        assert fastcopy.BACKEND.startswith("memmove")


def test_copy_ranges_exact_with_either_kernel(monkeypatch):
    fn, _ = fastcopy.find_dcopy()
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, 1 << 21, dtype=np.uint8)
    page = 64 << 10
    so = rng.permutation(32)[:20].astype(np.uint64) * np.uint64(page)
    do = rng.permutation(32)[:20].astype(np.uint64) * np.uint64(page)
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
