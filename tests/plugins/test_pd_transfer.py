"""PD KV transfer through SGLang's own Mooncake manager code on kvmesh, prefill -> decode.

This process is the prefill side: SGLang's plugin loader swaps the engine, SGLang's
``init_mooncake_transfer_engine`` builds it, and a real ``MooncakeKVManager`` (fields set
without its server-bound ``__init__``, tests/plugins/pd_harness.py) runs its own
``register_buffer_to_engine``, ``send_kvcache`` (index lists grouped into contiguous runs, every
layer's K and V in one ``batch_transfer_sync``) and ``send_aux``. The decode side is another
process (``python -m bench._pd``) with a registered CPU pool; pages are compared byte for byte
(SHA-256 on both sides). "network" runs the decode process under another host id, so the
prefill engine must take the network path (``tcp``) instead of a same-host one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from .sglang_env import ROOT, sglang_missing

_why = sglang_missing()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")

if _why is None:
    from bench._common import Child
    from bench._pd import KVPool, geometry_argv
    from kvmesh_sglang import pd as kpd

    from .pd_harness import load_plugin_via_sglang, prefill_manager, transfer_info

GEOM = {"layers": 4, "pages": 64, "page_size": 16, "heads": 2, "head_dim": 32}
NETWORK_ENV = {"KVMESH_HOST_ID": "decode-host-for-tests"}


def spawn_decode(network: bool, **geom: int) -> Child:
    g = {**GEOM, **geom}
    argv = [sys.executable, "-m", "bench._pd", *geometry_argv(**g)]
    return Child(argv, env=NETWORK_ENV if network else {}, timeout=60, cwd=str(ROOT))


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    load_plugin_via_sglang(tmp_path_factory.mktemp("eps"))
    from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as mte

    eng = mte.init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    assert isinstance(eng, kpd.KvmeshTransferEngine)
    pool = KVPool(**GEOM)
    pool.fill(seed=7)
    with pytest.MonkeyPatch.context() as mp:
        mgr = prefill_manager(pool, mp)
        executor = concurrent.futures.ThreadPoolExecutor(4)
        yield mgr, pool, executor
        executor.shutdown()
        mgr.deregister_buffer_to_engine()


@pytest.fixture(scope="module", params=["same-host", "network"])
def decode(request):
    child = spawn_decode(request.param == "network")
    yield request.param, child
    child.close()


def zero_digest(pages, aux_row=None) -> str:
    z = KVPool(**GEOM)
    z.zero()
    return z.page_digest(pages, aux_row)


def send_request(mgr, executor, child, src_pages, dst_pages, src_aux, dst_aux) -> tuple[int, int]:
    sid = child.info["session_id"]
    rc = mgr.send_kvcache(
        sid,
        np.asarray(src_pages, np.int32),
        child.info["kv_data_ptrs"],
        np.asarray(dst_pages, np.int32),
        executor,
    )
    rc_aux = mgr.send_aux(transfer_info(sid, dst_aux), src_aux, child.info["aux_data_ptrs"])
    return rc, rc_aux


def test_request_pages_land_byte_for_byte(prefill, decode):
    mgr, pool, executor = prefill
    mode, child = decode
    child.call("zero")
    # Runs of different shapes on both sides: SGLang splits them into contiguous blocks.
    src = [3, 4, 5, 9, 10, 11, 12, 30, 31, 40]
    dst = [0, 1, 2, 20, 21, 22, 50, 51, 52, 60]
    eng = mgr.engine
    before = dict(eng.stats["by_transport"])
    assert send_request(mgr, executor, child, src, dst, 2, 5) == (0, 0)
    assert child.call("digest", pages=dst, aux_row=5)["digest"] == pool.page_digest(src, 2)
    rest = sorted(set(range(GEOM["pages"])) - set(dst))
    assert child.call("digest", pages=rest, aux_row=6)["digest"] == zero_digest(rest, 6)
    used = {k for k, v in eng.stats["by_transport"].items() if v != before.get(k, 0)}
    if mode == "network":
        assert used == {"tcp"}
    else:
        assert "tcp" not in used and used  # nixl (cma) or shm on one host


def test_concurrent_requests_from_threads(prefill, decode):
    mgr, pool, executor = prefill
    _, child = decode
    child.call("zero")
    rng = np.random.default_rng(11)
    nreq, per = 16, 4
    dst_all = rng.permutation(GEOM["pages"])[: nreq * per].reshape(nreq, per)
    src_all = [rng.choice(GEOM["pages"], per, replace=False) for _ in range(nreq)]
    with concurrent.futures.ThreadPoolExecutor(4) as workers:  # SGLang's transfer workers
        results = list(
            workers.map(
                lambda i: send_request(mgr, executor, child, src_all[i], dst_all[i], i, 63 - i),
                range(nreq),
            )
        )
    assert results == [(0, 0)] * nreq
    for i in range(nreq):
        got = child.call("digest", pages=dst_all[i].tolist(), aux_row=63 - i)["digest"]
        assert got == pool.page_digest(src_all[i], i), f"request {i}"


def test_out_of_region_addresses_refused_before_a_byte_moves(prefill, decode):
    mgr, pool, _ = prefill
    _, child = decode
    child.call("zero")
    eng = mgr.engine
    sid = child.info["session_id"]
    item, last = pool.item_len, GEOM["pages"] - 1
    src_ptrs, dst_ptrs = pool.kv_data_ptrs, child.info["kv_data_ptrs"]
    everything = list(range(GEOM["pages"]))
    # Valid blocks in every layer buffer but one; in that one, a block runs past the end of
    # the peer's buffer by one byte. Whichever buffer it is (first or last group), nothing of
    # the batch may land: the whole batch is refused before it starts.
    for bad in (0, len(src_ptrs) - 1):
        good = [(s, d, item) for j, (s, d) in enumerate(zip(src_ptrs, dst_ptrs)) if j != bad]
        blocks = [*good, (src_ptrs[bad], dst_ptrs[bad] + last * item + 1, item)]
        s, d, n = (list(x) for x in zip(*blocks))
        assert eng.batch_transfer_sync(sid, s, d, n) == kpd.E_PEER_REGION
        assert child.call("digest", pages=everything)["digest"] == zero_digest(everything)
    # An address the peer never registered at all, and a source outside our registrations.
    assert eng.transfer_sync(sid, src_ptrs[0], 4096, item) == kpd.E_PEER_REGION
    assert (
        eng.batch_transfer_sync(sid, [src_ptrs[0], 8192], [dst_ptrs[0], dst_ptrs[1]], [item, 16])
        == kpd.E_NOT_REGISTERED
    )
    assert child.call("digest", pages=everything)["digest"] == zero_digest(everything)
    s, d, n = (list(x) for x in zip(*good))
    assert eng.batch_transfer_sync(sid, s, d, n) == 0  # the same valid blocks alone do land
    assert child.call("digest", pages=[0])["digest"] != zero_digest([0])


@pytest.mark.parametrize("mode", ["same-host", "network"])
def test_decode_killed_mid_transfer_fails_without_hanging(prefill, mode):
    mgr, _, _ = prefill
    # A bigger decode pool, so that one request takes a while: 4 x 32 MiB.
    geom = {"layers": 2, "pages": 256, "page_size": 64, "heads": 8, "head_dim": 128}
    src_pool = KVPool(**geom)
    src_pool.fill(seed=3)
    eng = mgr.engine
    assert eng.batch_register(src_pool.kv_data_ptrs, src_pool.kv_data_lens) == 0
    child = spawn_decode(mode == "network", **geom)
    try:
        sid = child.info["session_id"]
        n = len(src_pool.kv_data_ptrs)
        args = (sid, src_pool.kv_data_ptrs, child.info["kv_data_ptrs"], src_pool.kv_data_lens[:n])
        assert eng.batch_transfer_sync(*args) == 0
        assert eng.send_probe(sid) == 0
        calls: list[tuple[float, float, int]] = []
        stop = threading.Event()

        blocks = list(zip(*args[1:]))

        def sender() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                rc = mgr._transfer_data(sid, blocks)  # SGLang's: -> batch_transfer_sync
                calls.append((t0, time.monotonic(), rc))
                if rc != 0:
                    return

        th = threading.Thread(target=sender, daemon=True)
        th.start()
        time.sleep(0.3)
        t_kill = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        th.join(15)
        stop.set()
        assert not th.is_alive(), "batch_transfer_sync hung after the decode process died"
        t0, t1, rc = calls[-1]
        assert rc < 0 and t1 - t_kill < 10
        assert rc in (kpd.E_PEER_DEAD, kpd.E_UNREACHABLE, kpd.E_FAILED, kpd.E_TIMEOUT), rc
        assert all(r == 0 for _, _, r in calls[:-1])
        # Later calls and probes fail at once (SGLang then blacklists the session).
        t = time.monotonic()
        assert eng.batch_transfer_sync(*args) < 0
        assert eng.send_probe(sid) < 0
        assert time.monotonic() - t < 10
    finally:
        if child.proc.poll() is None:
            child.proc.kill()
        child.proc.wait(10)
        with contextlib.suppress(BrokenPipeError):
            child.close()
        assert eng.batch_deregister(src_pool.kv_data_ptrs) == 0


def test_blocks_in_any_order_across_layers(prefill, decode):
    """One batch mixing every layer buffer in random order lands like the ordered one."""
    mgr, pool, _ = prefill
    _, child = decode
    child.call("zero")
    rng = np.random.default_rng(5)
    src_pages = rng.choice(GEOM["pages"], 8, replace=False)
    dst_pages = rng.choice(GEOM["pages"], 8, replace=False)
    item = pool.item_len
    blocks = [
        (s + int(a) * item, d + int(b) * item, item)
        for s, d in zip(pool.kv_data_ptrs, child.info["kv_data_ptrs"])
        for a, b in zip(src_pages, dst_pages)
    ]
    order = rng.permutation(len(blocks))
    src, dst, ln = (list(x) for x in zip(*(blocks[i] for i in order)))
    assert mgr.engine.batch_transfer_sync(child.info["session_id"], src, dst, ln) == 0
    got = child.call("digest", pages=dst_pages.tolist())["digest"]
    assert got == pool.page_digest(src_pages)


def test_hung_decode_times_out(prefill):
    """A stopped decode process (SIGSTOP) on the network path turns into -6 at the deadline.

    (On one host UCX cma writes straight into the stopped process's memory, so there is
    nothing to wait for there.)
    """
    mgr, _, _ = prefill
    geom = {"layers": 2, "pages": 256, "page_size": 64, "heads": 8, "head_dim": 128}
    src_pool = KVPool(**geom)
    src_pool.fill(seed=2)
    eng = mgr.engine
    assert eng.batch_register(src_pool.kv_data_ptrs, src_pool.kv_data_lens) == 0
    child = spawn_decode(True, **geom)
    old_timeout = eng.timeout
    try:
        sid = child.info["session_id"]
        args = (sid, src_pool.kv_data_ptrs, child.info["kv_data_ptrs"], src_pool.kv_data_lens)
        assert eng.batch_transfer_sync(*args) == 0
        os.kill(child.pid, signal.SIGSTOP)
        eng.timeout = 1.5  # what KVMESH_SGLANG_PD_TIMEOUT=1.5 sets
        t = time.monotonic()
        assert eng.batch_transfer_sync(*args) == kpd.E_TIMEOUT
        assert time.monotonic() - t < 1.5 + 5.0 + 3
    finally:
        eng.timeout = old_timeout
        os.kill(child.pid, signal.SIGCONT)
        child.close()
        assert eng.batch_deregister(src_pool.kv_data_ptrs) == 0
