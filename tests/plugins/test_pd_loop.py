"""SGLang's whole Mooncake PD loop on kvmesh: two processes, a prefill and a decode instance.

Each instance is a process (tests/plugins/pd_loop_peer.py) that runs SGLang 0.5.23's own
classes on CPU, with the kvmesh plugin loaded by SGLang's plugin loader: the runtime context
published from ``ServerArgs``, ``maybe_init_shared_mooncake_transfer_engine`` (which builds
``KvmeshTransferEngine``), ``MooncakeKVBootstrapServer`` (aiohttp), ``MooncakeKVManager`` with
its ZMQ bootstrap/status threads, transfer workers and decode heartbeat, and a
``MooncakeKVSender`` / ``MooncakeKVReceiver`` per request. The test process only plays the two
schedulers: it creates senders and receivers, calls ``send_metadata``, ``init``/``send`` and
``poll`` as ``disaggregation/prefill.py`` and ``decode.py`` do, and compares bytes.

What is faked, and why (everything else is SGLang's code, unpatched):

* the model: ``ServerArgs`` points at a directory holding only a ``config.json`` of a tiny
  Llama (publishing resolves the model config; no weights or tokenizer are loaded);
* the schedulers: there is no model to run, so the test makes the calls that
  ``disaggregation/prefill.py`` and ``decode.py`` make (senders and receivers created, polled,
  ``send_metadata``, ``init``/``send``), in their order. The KV pool and the metadata rows are
  SGLang's own (``MHATokenToKVPool`` on CPU, ``MetadataBuffers``), and ``KVArgs`` is filled
  with SGLang's own helpers as ``_init_kv_manager`` fills it (pd_loop_peer.py);
* one runtime-context value, ``pp_group`` (the PP process group handle), is set to None with
  SGLang's own ``get_parallel().override_permanently``: ``publish`` cannot supply it, it comes
  from torch.distributed init, and ``CommonKVManager`` only uses it when ``pp_size > 1``. No
  collective runs on this path, so no process group is created;
* ``SGLANG_HOST_IP=127.0.0.1`` (SGLang's own setting) keeps every socket on loopback;
* the plugin's entry point is made visible to ``importlib.metadata`` with a dist-info built
  from pyproject.toml (a worktree is not installed; tests/plugins/pd_harness.py).

The processes exit when the test process closes them (or, for the killed decode, by SIGKILL);
no SGLang thread outlives its process.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import sys
import time

import numpy as np
import pytest

from kvmesh.launcher import free_ports

from .sglang_env import ROOT, sglang_missing

_why = sglang_missing()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")

if _why is None:
    from bench._common import Child
    from bench._pd import geometry_argv

    from .pd_loop_peer import MODEL_CONFIG

# 2 layers x (K, V) x 256 pages of 64 tokens x 8 heads x 128 dims, bf16: 32 MiB per buffer,
# 128 KiB per page of one buffer; one whole-pool request moves 128 MiB. SGLang's pool keeps
# page 0 as its padding page, so requests use pages 1..256.
GEOM = {"layers": 2, "pages": 256, "page_size": 64, "heads": 8, "head_dim": 128}
PAGES = np.arange(1, GEOM["pages"] + 1)
KV_SUCCESS, KV_FAILED, KV_WAITING = 4, 0, 2  # sglang KVPoll values
PROBE_INTERVAL = 0.2
WRITE_TIMEOUT = 5.0


def _free_port() -> int:
    # Below the ephemeral range: the child binds it later (see kvmesh.launcher.free_ports).
    return free_ports(1)[0]


def spawn(role: str, dirs: dict[str, str], *extra: str, host_id: str | None = None) -> Child:
    env = {"SGLANG_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"}
    # The deadline of one kvmesh write (a hung decode turns into -6 after it).
    env["KVMESH_SGLANG_PD_TIMEOUT"] = str(WRITE_TIMEOUT)
    # SGLang's failed-session probe runs every 30 s by default; the kill test watches it.
    env["SGLANG_FAILED_SESSION_PROBE_INTERVAL_S"] = str(PROBE_INTERVAL)
    if host_id:
        env["KVMESH_HOST_ID"] = host_id  # another "host": the network transport (tcp)
    argv = [sys.executable, "-m", "tests.plugins.pd_loop_peer", "--role", role]
    argv += [*geometry_argv(**GEOM), "--model-dir", dirs["model"], "--eps-dir", dirs["eps"]]
    return Child([*argv, *extra], env=env, timeout=120, cwd=str(ROOT))


def spawn_together(dirs: dict[str, str], *specs: tuple) -> list[Child]:
    """Instances started at once, each spec ``(role, extra args, host_id)``: a start-up is
    mostly SGLang's import, one core's work, so they overlap instead of queueing. No instance
    needs another one to start (the decode finds the prefill's bootstrap server per request)."""
    with concurrent.futures.ThreadPoolExecutor(len(specs)) as ex:
        futs = [ex.submit(spawn, role, dirs, *extra, host_id=h) for role, extra, h in specs]
        concurrent.futures.wait(futs)
    started = [f.result() for f in futs if f.exception() is None]
    errors = [f.exception() for f in futs if f.exception() is not None]
    if errors:
        for child in started:
            stop(child)
        raise errors[0]
    return started


def stop(child: Child) -> None:
    try:
        child.close()
    finally:
        if child.proc.poll() is None:
            child.proc.kill()
        child.proc.wait(10)
    assert child.proc.returncode is not None


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return {"model": str(model), "eps": str(tmp_path_factory.mktemp("eps"))}


@pytest.fixture(scope="module")
def instances(dirs):
    """The prefill, the decode and the kill test's victim decode (another host id: the
    network path), started together. The victim is a process of its own, used by that test
    only; the other two serve the whole module."""
    children = spawn_together(
        dirs,
        ("prefill", ("--bootstrap-port", str(_free_port()), "--seed", "5"), None),
        ("decode", (), None),
        ("decode", (), "decode-host-killed"),
    )
    yield dict(zip(("prefill", "decode", "victim"), children))
    for child in reversed(children):
        stop(child)


@pytest.fixture(scope="module")
def prefill(instances):
    return instances["prefill"]


@pytest.fixture(scope="module")
def decode(instances):
    return instances["decode"]


def run_requests(prefill, decode, rooms, src, dst, src_aux, dst_aux, chunks=1) -> None:
    """The two schedulers' calls for a batch of requests, in SGLang's order."""
    bootstrap_requests(prefill, decode, rooms, dst, dst_aux)
    for room, pages, row in zip(rooms, src, src_aux):
        prefill.call("send", room=room, pages=pages, aux_row=row, chunks=chunks)


def bootstrap_requests(prefill, decode, rooms, dst, dst_aux) -> None:
    """Senders and receivers up to WaitingForInput (the decode's metadata reached the prefill)."""
    assert set(prefill.call("open", rooms=rooms)["polls"].values()) <= {1, KV_WAITING}
    decode.call(
        "receive", rooms=rooms, pages=dst, aux_rows=dst_aux, addr=prefill.info["bootstrap_addr"]
    )
    # The prefill scheduler sends a request only once its sender is WaitingForInput, i.e. the
    # decode's registration and destination metadata arrived over ZMQ.
    end = time.monotonic() + 20
    while set(prefill.call("poll", rooms=rooms)["polls"].values()) != {KV_WAITING}:
        assert time.monotonic() < end, "prefill senders never left Bootstrapping"
        time.sleep(0.02)


def test_requests_land_byte_for_byte_through_sglang_loop(prefill, decode):
    for child in (prefill, decode):
        assert child.info["engine_class"] == "kvmesh_sglang.pd.KvmeshTransferEngine"
        assert child.info["session_id"].startswith("kvmesh://127.0.0.1:")
    before = prefill.call("stats")["engine"]
    rng = np.random.default_rng(3)
    nreq = 6
    # Disjoint destination pages per request; sources overlap freely and run in and out of
    # contiguous runs, so SGLang groups them into blocks of different lengths.
    run = np.arange(40, 52)  # request 0 lands in one contiguous run: one block per buffer
    others = rng.permutation(np.setdiff1d(PAGES, run))
    dst_all = np.concatenate([run, others[: (nreq - 1) * 12]]).reshape(nreq, 12)
    src_all = [rng.choice(PAGES, 12, replace=False) for _ in range(nreq)]
    src_all[1] = np.arange(100, 112)
    rooms = [1000 + i for i in range(nreq)]
    src_aux, dst_aux = list(range(nreq)), [60 - i for i in range(nreq)]
    run_requests(
        prefill,
        decode,
        rooms,
        [s.tolist() for s in src_all],
        [d.tolist() for d in dst_all],
        src_aux,
        dst_aux,
        chunks=2,  # chunked prefill: two send() calls per request (two index slices)
    )
    done_p = prefill.call("wait", rooms=rooms, within=30)
    done_d = decode.call("wait", rooms=rooms, within=30)
    assert not done_p["pending"] and not done_d["pending"]
    assert {r: v["status"] for r, v in done_p["concluded"].items()} == {
        str(r): KV_SUCCESS for r in rooms
    }
    assert {r: v["status"] for r, v in done_d["concluded"].items()} == {
        str(r): KV_SUCCESS for r in rooms
    }
    for i in range(nreq):
        want = prefill.call("digest", pages=src_all[i].tolist(), aux_row=src_aux[i])["digest"]
        got = decode.call("digest", pages=dst_all[i].tolist(), aux_row=dst_aux[i])["digest"]
        assert got == want, f"request {i}"
    # Pages and metadata rows no request named are still zero on the decode side.
    rest = sorted(set(range(GEOM["pages"] + 1)) - set(dst_all.ravel().tolist()))
    assert decode.call("digest", pages=rest, aux_row=0)["nonzero"] == 0
    # Every byte SGLang moved went through kvmesh: pages x (K+V of every layer) + aux rows.
    after = prefill.call("stats")
    page_bytes = sum(prefill.info["kv_item_lens"])
    expect = nreq * 12 * page_bytes + nreq * sum(prefill.info["aux_item_lens"])
    assert after["engine"]["bytes"] - before["bytes"] == expect
    moved = {
        k: v - before["by_transport"].get(k, 0) for k, v in after["engine"]["by_transport"].items()
    }
    moved = {k: v for k, v in moved.items() if v}
    assert sum(moved.values()) == expect and "tcp" not in moved, moved  # one host: no TCP
    assert after["failed_sessions"] == [] and after["engine"]["failures"] == 0


def test_decode_killed_mid_transfer_fails_the_senders(instances, prefill, decode):
    """A decode instance on the network path, first hung (SIGSTOP), then killed (SIGKILL).

    Hung: the write times out, the request fails, the session is blacklisted and SGLang's
    probe lifts the blacklist once the decode runs again. Killed with requests in flight: every
    sender of that decode reaches KVPoll.Failed within a bounded time through SGLang's own
    failure handling (transfer failure -> session blacklisted -> queued requests of the session
    fail without a transfer), the probe keeps it blacklisted, and the prefill keeps serving
    another decode.
    """
    victim = instances["victim"]
    whole = PAGES.tolist()  # 128 MiB per request, one session: one queue
    sid = victim.info["session_id"]
    try:
        # 1. A hung decode (SIGSTOP) mid-request: the kvmesh write times out (-6), SGLang fails
        # the request and blacklists the session; once the decode runs again, SGLang's probe
        # (KvmeshTransferEngine.send_probe == 0) lifts the blacklist and requests flow again.
        bootstrap_requests(prefill, victim, [1990], [whole], [2])
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            prefill.call("send", room=1990, pages=whole, aux_row=1)
            res = prefill.call("wait", rooms=[1990], within=WRITE_TIMEOUT + 20)
            assert res["concluded"]["1990"]["status"] == KV_FAILED, res
            assert res["concluded"]["1990"]["t"] - t0 < WRITE_TIMEOUT + 10
            stats = prefill.call("stats")
            assert sid in stats["failed_sessions"] and stats["by_code"].get("-6", 0) >= 1
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        end = time.monotonic() + 20
        while sid in prefill.call("stats")["failed_sessions"]:
            assert time.monotonic() < end, "SGLang's probe never lifted the blacklist"
            time.sleep(0.1)
        # The decode instance learnt the failure from the prefill's ZMQ status message.
        got = victim.call("wait", rooms=[1990], within=10)["concluded"]["1990"]
        assert got["status"] == KV_FAILED, got
        # Mooncake's status message carries no reason: the decode side's standard one.
        assert got["reason"].startswith("Failed to get kvcache from prefill instance"), got
        run_requests(prefill, victim, [1991], [[10, 11, 12, 13]], [[100, 101, 102, 103]], [4], [4])
        assert prefill.call("wait", rooms=[1991], within=30)["concluded"]["1991"]["status"] == 4
        assert victim.call("wait", rooms=[1991], within=30)["concluded"]["1991"]["status"] == 4
        want = prefill.call("digest", pages=[10, 11, 12, 13], aux_row=4)["digest"]
        assert victim.call("digest", pages=[100, 101, 102, 103], aux_row=4)["digest"] == want

        # 2. SIGKILL with requests in flight.
        before = prefill.call("stats")
        # Twelve queued requests, killed after the first: the rest are in flight or queued even
        # where loopback TCP is fast (the ones after the failure never transfer).
        n = 12
        rooms = [2000 + i for i in range(n)]
        run_requests(prefill, victim, rooms, [whole] * n, [whole] * n, [1] * n, [2] * n)
        first = prefill.call("wait", rooms=rooms[:1], within=30)
        assert first["concluded"][str(rooms[0])]["status"] == KV_SUCCESS, first
        t_kill = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        victim.proc.wait(10)
        res = prefill.call("wait", rooms=rooms, within=30)
        assert not res["pending"], f"senders still open 30 s after the kill: {res['pending']}"
        con = res["concluded"]
        late = max(v["t"] for v in con.values()) - t_kill
        assert late < 15, f"the last sender concluded {late:.1f} s after the kill"
        failed = [r for r in rooms if con[str(r)]["status"] == KV_FAILED]
        assert failed and failed == rooms[len(rooms) - len(failed) :], con  # mid-transfer
        reasons = [con[str(r)]["reason"] for r in failed]
        # The first failure is a kvmesh write that failed; the rest are SGLang's blacklist.
        assert reasons[0].startswith("Failed to send kv chunk of"), reasons
        assert all(r.startswith("Failed to send kv chunk of") or sid in r for r in reasons[1:])
        stats = prefill.call("stats")
        assert sid in stats["failed_sessions"] and stats["session_failures"][sid] >= 1
        new_codes = {int(c): n - before["by_code"].get(c, 0) for c, n in stats["by_code"].items()}
        assert {c for c, n in new_codes.items() if n} <= {-5, -7, -1}, new_codes  # dead peer
        # SGLang's probe loop asks kvmesh's send_probe about the blacklisted session: it keeps
        # failing (the back-off interval grows), so the session stays blacklisted.
        end = time.monotonic() + 10
        while stats["probe_intervals"].get(sid, 0) < 2 * PROBE_INTERVAL:
            assert time.monotonic() < end, stats["probe_intervals"]
            time.sleep(0.1)
            stats = prefill.call("stats")
        assert sid in stats["failed_sessions"]
    finally:
        if victim.proc.poll() is None:
            victim.proc.kill()
        stop(victim)
    # The prefill instance still serves a live decode.
    run_requests(prefill, decode, [3000], [[7, 8, 9]], [[200, 201, 202]], [3], [3])
    assert prefill.call("wait", rooms=[3000], within=30)["concluded"]["3000"]["status"] == 4
    assert decode.call("wait", rooms=[3000], within=30)["concluded"]["3000"]["status"] == 4
    want = prefill.call("digest", pages=[7, 8, 9], aux_row=3)["digest"]
    assert decode.call("digest", pages=[200, 201, 202], aux_row=3)["digest"] == want
