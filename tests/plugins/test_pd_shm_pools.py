"""``KVMESH_SGLANG_SHM_POOLS=1``: SGLang's CPU KV pools and PD aux buffers in kvmesh shared memory.

Real SGLang classes: the pools are built in a fresh process after SGLang's plugin loader ran
(tests/plugins/shm_pool_child.py), with and without the switch. The PD transfer runs SGLang's
own ``MooncakeKVManager`` code (tests/plugins/pd_harness.py) from this process into a decode
process whose pool was allocated the way the hook allocates (``bench._pd --pool-memory shm``):
same host, so the engine must pick the ``shm`` transport, and land every byte.
"""

from __future__ import annotations

import concurrent.futures
import errno
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from .sglang_env import ROOT, sglang_missing

_why = sglang_missing()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")

if _why is None:
    import torch

    from bench._common import Child
    from bench._pd import KVPool, geometry_argv
    from kvmesh.transfer import MemoryKind, get_engine
    from kvmesh_sglang import pd as kpd
    from kvmesh_sglang import shm_pools

    from .pd_harness import load_plugin_via_sglang, prefill_manager, transfer_info

GEOM = {"layers": 4, "pages": 64, "page_size": 16, "heads": 2, "head_dim": 32}


def _pool_report(tmp, on: bool) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != shm_pools.ENV_SHM_POOLS}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if on:
        env[shm_pools.ENV_SHM_POOLS] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "tests.plugins.shm_pool_child", str(tmp)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _report(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def test_real_sglang_cpu_pools_live_in_shared_memory_only_with_the_switch(tmp_path):
    # Both processes at once: importing SGLang is most of the time.
    on = _pool_report(tmp_path / "on", True)
    off = _pool_report(tmp_path / "off", False)
    r_on, r_off = _report(on), _report(off)

    assert set(r_on["patched"]) == set(shm_pools.TARGETS)
    for part in ("mha", "mla", "aux"):
        assert r_on[part]["kinds"] and set(r_on[part]["kinds"]) == {"shm"}, part
    mha = r_on["mha"]
    # Pointer tables SGLang captured inside _create_buffers describe the shared tensors.
    assert mha["k_ptrs_match"] and mha["v_ptrs_match"] and mha["data_ptrs_match"]
    assert mha["zeroed"] and mha["dtype"] == "torch.bfloat16"
    assert mha["shapes"] == r_off["mha"]["shapes"]
    assert mha["same_file"] and r_on["mla"]["same_file"]
    # At least one allocation per layer (SGLang fuses a layer's K and V into one when shapes match).
    least = len(r_on["mha"]["kinds"]) // 2 + len(r_on["mla"]["kinds"]) + len(r_on["aux"]["kinds"])
    assert r_on["stats"]["buffers"] >= least and r_on["stats"]["fallbacks"] == 0
    # Freed with the pool (the engine's own fence file stays), and nothing left after exit.
    assert r_on["files_after_free"] < r_on["files_before_free"]
    assert r_on["files_before_free"] - r_on["files_after_free"] == r_on["stats"]["buffers"]
    assert not glob.glob(f"/dev/shm/kvmesh-{r_on['pid']}-*")

    # Switch off: SGLang's pools unchanged (private memory, same shapes and pointer tables).
    assert r_off["patched"] == [] and r_off["stats"]["buffers"] == 0
    for part in ("mha", "mla", "aux"):
        assert set(r_off[part]["kinds"]) == {"dram"}, part
    assert r_off["mha"]["k_ptrs_match"] and r_off["mha"]["data_ptrs_match"]


class _Pool:
    def __init__(self, device: str) -> None:
        self.device = device


def _in_shared_memory(t) -> bool:
    region = get_engine().register_raw(t.data_ptr(), t.numel() * t.element_size())
    try:
        return region.kind is MemoryKind.SHM
    finally:
        get_engine().unregister(region)


def test_hook_serves_only_cpu_pools_and_plain_factories():
    out = torch.empty(4)

    def create(pool):
        pool.k = torch.zeros((8, 2, 4), dtype=torch.bfloat16, device="cpu")
        pool.ones = torch.ones(3, 5, dtype=torch.int32)
        pool.full = torch.full((4,), 7.5)
        pool.empty = torch.empty(16, dtype=torch.uint8, device=torch.device("cpu"))
        pool.grad = torch.zeros(4, requires_grad=True)  # not a pool buffer: torch's
        pool.out = torch.zeros(4, out=out)
        pool.none = torch.zeros(0)

    cpu, cuda = _Pool("cpu"), _Pool("cuda")
    before = shm_pools.stats["buffers"]
    shm_pools.around_pool(create, cuda)
    assert shm_pools.stats["buffers"] == before  # a CUDA pool's method runs untouched
    assert not _in_shared_memory(cuda.k)
    shm_pools.around_pool(create, cpu)
    assert shm_pools.stats["buffers"] == before + 4
    for name in ("k", "ones", "full", "empty"):
        assert _in_shared_memory(getattr(cpu, name)), name
    for name in ("grad", "out"):
        assert not _in_shared_memory(getattr(cpu, name)), name
    assert cpu.k.shape == (8, 2, 4) and cpu.k.dtype == torch.bfloat16 and not cpu.k.any()
    assert cpu.ones.dtype == torch.int32 and bool((cpu.ones == 1).all())
    assert cpu.full.dtype == torch.float32 and bool((cpu.full == 7.5).all())
    assert cpu.grad.requires_grad and cpu.out is out
    # Outside the hook nothing changes.
    assert not _in_shared_memory(torch.zeros(1024))


def test_shared_tensor_file_lives_as_long_as_any_view():
    t = shm_pools.shared_tensor((64, 32), torch.float16)
    region = get_engine().register_raw(t.data_ptr(), t.numel() * 2)
    name = region.shm.name
    get_engine().unregister(region)
    del region
    view = t[3:5]
    del t
    import gc

    gc.collect()
    assert os.path.exists(f"/dev/shm/{name}")
    view.fill_(1)
    del view
    gc.collect()
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    load_plugin_via_sglang(tmp_path_factory.mktemp("eps"))
    from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as mte

    mte.init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    pool = KVPool(**GEOM, memory="shm")
    pool.fill(seed=21)
    with pytest.MonkeyPatch.context() as mp:
        mgr = prefill_manager(pool, mp)
        executor = concurrent.futures.ThreadPoolExecutor(4)
        yield mgr, pool, executor
        executor.shutdown()
        mgr.deregister_buffer_to_engine()


@pytest.fixture(scope="module")
def shm_decode():
    argv = [sys.executable, "-m", "bench._pd", *geometry_argv(**GEOM, memory="shm")]
    child = Child(argv, timeout=60, cwd=str(ROOT))
    yield child
    child.close()


def _zero_digest(pages, aux_row=None) -> str:
    z = KVPool(**GEOM)
    z.zero()
    return z.page_digest(pages, aux_row)


def _send(mgr, executor, child, src, dst, src_aux, dst_aux) -> tuple[int, int]:
    sid = child.info["session_id"]
    dptrs = child.info["kv_data_ptrs"]
    rc = mgr.send_kvcache(
        sid, np.asarray(src, np.int32), dptrs, np.asarray(dst, np.int32), executor
    )
    return rc, mgr.send_aux(transfer_info(sid, dst_aux), src_aux, child.info["aux_data_ptrs"])


def test_pd_transfer_into_shm_pool_is_byte_exact_over_shm(prefill, shm_decode):
    mgr, pool, executor = prefill
    child = shm_decode
    assert child.info["pool_memory"] == "shm"
    child.call("zero")
    eng = mgr.engine
    before = dict(eng.stats["by_transport"])
    rng = np.random.default_rng(3)
    nreq, per = 8, 6
    dst_all = rng.permutation(GEOM["pages"])[: nreq * per].reshape(nreq, per)
    src_all = [rng.choice(GEOM["pages"], per, replace=False) for _ in range(nreq)]
    with concurrent.futures.ThreadPoolExecutor(4) as workers:
        results = list(
            workers.map(
                lambda i: _send(mgr, executor, child, src_all[i], dst_all[i], i, 40 + i),
                range(nreq),
            )
        )
    assert results == [(0, 0)] * nreq
    for i in range(nreq):
        got = child.call("digest", pages=dst_all[i].tolist(), aux_row=40 + i)["digest"]
        assert got == pool.page_digest(src_all[i], i), f"request {i}"
    rest = sorted(set(range(GEOM["pages"])) - set(dst_all.ravel().tolist()))
    assert child.call("digest", pages=rest, aux_row=0)["digest"] == _zero_digest(rest, 0)
    used = {k for k, v in eng.stats["by_transport"].items() if v != before.get(k, 0)}
    assert used == {"shm"}


def test_shm_pool_out_of_region_writes_refused(prefill, shm_decode):
    mgr, pool, _ = prefill
    child = shm_decode
    child.call("zero")
    eng = mgr.engine
    sid = child.info["session_id"]
    item, last = pool.item_len, GEOM["pages"] - 1
    src, dst = pool.kv_data_ptrs, child.info["kv_data_ptrs"]
    lens = child.info["kv_data_lens"]
    everything = list(range(GEOM["pages"]))
    # One byte past a layer buffer: inside the page-rounded shared file when the buffer is not
    # a whole number of pages, but outside what the peer registered.
    assert eng.batch_transfer_sync(sid, [src[0]], [dst[0] + last * item + 1], [item]) == (
        kpd.E_PEER_REGION
    )
    # Just past a buffer's end and just before a buffer's start, where the peer registered
    # nothing else: its buffers may be mapped back to back (one's end is then another's
    # start, and a write there is legal).
    spans = list(zip(dst + child.info["aux_data_ptrs"], lens + child.info["aux_data_lens"]))

    def unregistered(a: int, n: int) -> bool:
        return not any(p < a + n and a < p + m for p, m in spans)

    after = next(p + n for p, n in zip(dst, lens) if unregistered(p + n, 8))
    before = next(p - 64 for p in dst if unregistered(p - 64, 64))
    assert eng.transfer_sync(sid, src[1], after, 8) == kpd.E_PEER_REGION
    assert eng.transfer_sync(sid, src[0], before, 64) == kpd.E_PEER_REGION
    assert child.call("digest", pages=everything, aux_row=0)["digest"] == _zero_digest(
        everything, 0
    )
    assert eng.transfer_sync(sid, src[0], dst[0] + last * item, item) == 0
    assert child.call("digest", pages=[last])["digest"] != _zero_digest([last])


def test_private_decode_pool_keeps_the_cma_path(prefill):
    mgr, pool, executor = prefill
    argv = [sys.executable, "-m", "bench._pd", *geometry_argv(**GEOM)]
    child = Child(argv, timeout=60, cwd=str(ROOT))
    try:
        assert child.info["pool_memory"] == "private"
        eng = mgr.engine
        before = dict(eng.stats["by_transport"])
        assert _send(mgr, executor, child, [1, 2, 3], [7, 8, 9], 1, 2) == (0, 0)
        assert child.call("digest", pages=[7, 8, 9], aux_row=2)["digest"] == pool.page_digest(
            [1, 2, 3], 1
        )
        used = {k for k, v in eng.stats["by_transport"].items() if v != before.get(k, 0)}
        assert "shm" not in used and "tcp" not in used and used
    finally:
        child.close()


def test_write_after_decode_deregistered_its_shm_pool_fails_and_lands_nothing(prefill):
    mgr, pool, executor = prefill
    argv = [sys.executable, "-m", "bench._pd", *geometry_argv(**GEOM, memory="shm")]
    child = Child(argv, timeout=60, cwd=str(ROOT))
    try:
        assert _send(mgr, executor, child, [4, 5], [10, 11], 3, 3) == (0, 0)  # route is open
        child.call("zero")
        assert child.call("deregister")["rc"] == 0
        sid, src, dst = child.info["session_id"], pool.kv_data_ptrs, child.info["kv_data_ptrs"]
        rc = mgr.engine.batch_transfer_sync(sid, src, dst, [pool.item_len] * len(src))
        assert rc == kpd.E_PEER_REGION
        everything = list(range(GEOM["pages"]))
        assert child.call("digest", pages=everything)["digest"] == _zero_digest(everything)
    finally:
        child.close()


def test_short_dev_shm_leaves_the_buffer_private(monkeypatch):
    # A container's 64 MiB /dev/shm: a pool that does not fit must not be mapped (SIGBUS on
    # first touch); it stays in private memory and the fallback is counted (and logged).
    # The engine's own reservation (shmfile.reserve) is what refuses: here it finds 1 MiB.
    real = os.posix_fallocate

    def short(fd, offset, length):
        if offset + length > 1 << 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", short)
    pool = _Pool("cpu")
    before = dict(shm_pools.stats)

    def create(p):
        p.small = torch.zeros(1024, dtype=torch.uint8)
        p.big = torch.zeros(2 << 20, dtype=torch.uint8)

    shm_pools.around_pool(create, pool)
    assert _in_shared_memory(pool.small) and not _in_shared_memory(pool.big)
    assert shm_pools.stats["fallbacks"] == before["fallbacks"] + 1
    assert shm_pools.stats["buffers"] == before["buffers"] + 1


def test_sglang_pd_loop_with_shm_pools_moves_every_byte_over_shm(tmp_path, monkeypatch):
    """SGLang's whole Mooncake loop (tests/plugins/test_pd_loop.py's two instances, SGLang's own
    ``MHATokenToKVPool`` and ``MetadataBuffers``) with the switch on in both instances."""
    from . import test_pd_loop as loop

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(loop.MODEL_CONFIG))
    dirs = {"model": str(model), "eps": str(tmp_path / "eps")}
    monkeypatch.setenv(shm_pools.ENV_SHM_POOLS, "1")  # inherited by both instances
    prefill, decode = loop.spawn_together(
        dirs,
        ("prefill", ("--bootstrap-port", str(loop._free_port()), "--seed", "9"), None),
        ("decode", (), None),
    )
    try:
        try:
            before = prefill.call("stats")["engine"]
            rng = np.random.default_rng(8)
            dst = rng.permutation(loop.PAGES)[:24].reshape(2, 12)
            src = [rng.choice(loop.PAGES, 12, replace=False) for _ in range(2)]
            rooms = [500, 501]
            loop.run_requests(
                prefill, decode, rooms, [s.tolist() for s in src], dst.tolist(), [1, 2], [7, 8]
            )
            for child in (prefill, decode):
                done = child.call("wait", rooms=rooms, within=30)
                assert {v["status"] for v in done["concluded"].values()} == {loop.KV_SUCCESS}
            for i in range(2):
                want = prefill.call("digest", pages=src[i].tolist(), aux_row=1 + i)["digest"]
                got = decode.call("digest", pages=dst[i].tolist(), aux_row=7 + i)["digest"]
                assert got == want, f"request {i}"
            after = prefill.call("stats")["engine"]["by_transport"]
            moved = {k: v - before["by_transport"].get(k, 0) for k, v in after.items()}
            assert {k for k, v in moved.items() if v} == {"shm"}, moved  # KV pages and aux rows
        finally:
            loop.stop(decode)
    finally:
        loop.stop(prefill)


def test_shm_decode_killed_mid_transfer_fails_the_sender_and_spares_it(prefill):
    """The decode process of a same-host (shm) pool killed while the prefill writes its pool
    in a loop: the sender never crashes or hangs (its mapping of the file outlives the
    owner, so a write in flight lands in orphaned pages), fails with E_PEER_DEAD within a
    bound, and never succeeds again after its first failure. Measured: writes stopped
    succeeding 50 ms after the SIGKILL."""
    import signal
    import threading
    import time

    mgr, pool, _ = prefill
    argv = [sys.executable, "-m", "bench._pd", *geometry_argv(**GEOM, memory="shm")]
    child = Child(argv, timeout=60, cwd=str(ROOT))
    sid, src, dst = child.info["session_id"], pool.kv_data_ptrs, child.info["kv_data_ptrs"]
    lens = [pool.item_len * GEOM["pages"]] * len(src)
    rcs: list[tuple[float, int]] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            rcs.append((time.monotonic(), mgr.engine.batch_transfer_sync(sid, src, dst, lens)))

    th = threading.Thread(target=loop)
    try:
        th.start()
        # Killed once a write went through (not after a fixed 0.3 s: the first write of a
        # whole pool can take longer than that on a loaded machine).
        end = time.monotonic() + 30
        while not rcs and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.05)
        killed = time.monotonic()
        os.kill(child.proc.pid, signal.SIGKILL)
        child.proc.wait(10)
        # Until the first failure (bounded below) and 20 writes and 0.5 s after the kill, not
        # a fixed 2 s: the writes after the first failure show it never succeeds again.
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            seen = [rc for t, rc in list(rcs) if t > killed]
            first = next((i for i, rc in enumerate(seen) if rc), None)
            if first is not None and len(seen) - first > 20 and time.monotonic() - killed > 0.5:
                break
            time.sleep(0.01)
        stop.set()
        th.join(30)
        assert not th.is_alive(), "the sender hung on a dead peer's pool"
    finally:
        stop.set()
        child.close()
    before = [rc for t, rc in rcs if t < killed]
    after = [(t - killed, rc) for t, rc in rcs if t > killed]
    assert before and set(before) == {0}  # the loop moved bytes over shm before the kill
    failed = [t for t, rc in after if rc != 0]
    assert failed and failed[0] < 1.5, after[-3:]
    assert {rc for t, rc in after if t >= failed[0]} == {kpd.E_PEER_DEAD}
