"""The NIXL transport inside the engine: real peer engines in child processes, loopback.

Peers are ``tests/transfer/peer.py`` processes owning a private (non-shared) DRAM pool, which
same-host peers can only reach through NIXL (UCX cma) or plain TCP.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvmesh.transfer import (
    EngineConfig,
    MemoryKind,
    Op,
    PeerDeadError,
    SegmentNotFound,
    TransferEngine,
    TransferError,
    TransportKind,
)
from kvmesh.transfer import nixl as na
from kvmesh.transfer.transports import nixl as nt

from .util import Peer, pattern, sha

pytestmark = pytest.mark.skipif(not na.available(), reason=f"NIXL: {na.unavailable_reason()}")

POOL = 32 << 20
SEED = 11


def _engine(**nixl: str) -> TransferEngine:
    return TransferEngine(config=EngineConfig(nixl=dict(nixl)))


def _peer(*extra: str, nixl: str | None = None, size: int = POOL) -> Peer:
    env = {"KVMESH_NIXL": nixl} if nixl else {}
    return Peer("--kind", "dram", "--size", str(size), "--seed", str(SEED), *extra, env=env)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def dram_peer():
    with _peer() as p:
        yield p


def test_dram_segment_goes_through_nixl(dram_peer):
    with _engine() as eng:
        seg = eng.open_segment(dram_peer.address, "pool")
        assert seg.kind is MemoryKind.DRAM and seg.desc.nixl_agent
        buf = np.zeros(POOL, np.uint8)
        local = eng.register(buf)
        # READ the whole pool as scattered 64 KiB pages, in a shuffled order
        page = 64 << 10
        n = POOL // page
        perm = np.random.default_rng(3).permutation(n).astype(np.int64)
        res = eng.transfer(Op.READ, local, perm * page, seg, np.arange(n) * page, page)
        assert res.transports == [TransportKind.NIXL]
        expect = pattern(SEED, 0, POOL).reshape(n, page)
        assert sha(buf.reshape(n, page)[perm]) == sha(expect)
        # WRITE 16 KiB pages back into other places, then check them on the peer
        small = 16 << 10
        src = pattern(99, 0, 256 * small)
        buf[: src.size] = src
        dst = np.random.default_rng(4).choice(POOL // small, 256, replace=False).astype(np.int64)
        res = eng.transfer(Op.WRITE, local, np.arange(256) * small, seg, dst * small, small)
        assert res.transports == [TransportKind.NIXL]
        for i in (0, 17, 255):
            got = dram_peer.cmd("sha", offset=int(dst[i]) * small, length=small)["sha"]
            assert got == sha(src[i * small : (i + 1) * small])
        # one big piece, and a 4 KiB one
        res = eng.transfer(Op.READ, local, [0], seg, [0], [POOL])
        assert res.transports == [TransportKind.NIXL]
        assert dram_peer.cmd("sha", offset=0, length=POOL)["sha"] == sha(buf)
        eng.transfer(Op.READ, local, [8], seg, [4096 + 8], [4096])
        assert sha(buf[8 : 8 + 4096]) == dram_peer.cmd("sha", offset=4096 + 8, length=4096)["sha"]
        tr = eng.transport(TransportKind.NIXL)
        assert tr.started and tr.agent.progress_mode == "thread"


def test_async_batches_and_threads(dram_peer):
    with _engine() as eng:
        seg = eng.open_segment(dram_peer.address, "pool")
        buf = np.zeros(POOL, np.uint8)
        local = eng.register(buf)
        page = 32 << 10
        n = POOL // page
        # several batches in flight at once, each a quarter of the pool
        batches = []
        for q in range(4):
            b = eng.batch()
            idx = np.arange(q * n // 4, (q + 1) * n // 4)
            b.add_many(Op.READ, local, idx * page, seg, idx * page, page)
            b.submit(timeout=60)
            batches.append(b)
        for b in batches:
            r = b.wait(60)
            assert r.transports == [TransportKind.NIXL] and r.failed == 0
            b.free()
        assert sha(buf) == sha(pattern(SEED, 0, POOL))
        # several threads submitting synchronous batches at once
        buf[:] = 0
        errors: list[BaseException] = []

        def worker(t: int) -> None:
            try:
                for k in range(8):
                    idx = np.arange(t * n // 4 + k * n // 32, t * n // 4 + (k + 1) * n // 32)
                    eng.transfer(Op.READ, local, idx * page, seg, idx * page, page, timeout=60)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert sha(buf) == sha(pattern(SEED, 0, POOL))


@pytest.mark.parametrize("read_mode", ["socket", "push", "nixl"])
def test_forced_tcp_read_modes(read_mode):
    """UCX_TLS=tcp: WRITEs are NIXL puts; READs take the configured path; bytes identical."""
    nixl = f"ucx_tls=tcp,read_mode={read_mode}"
    with _peer(nixl=nixl) as peer, _engine(ucx_tls="tcp", read_mode=read_mode) as eng:
        seg = eng.open_segment(peer.address, "pool")
        buf = np.zeros(POOL, np.uint8)
        local = eng.register(buf)
        page = 256 << 10
        n = 64
        src = pattern(5, 0, n * page)
        buf[: src.size] = src
        dst = np.random.default_rng(8).choice(POOL // page, n, replace=False).astype(np.int64)
        res = eng.transfer(Op.WRITE, local, np.arange(n) * page, seg, dst * page, page)
        assert res.transports == [TransportKind.NIXL]
        route = seg._routes[(MemoryKind.DRAM, -1)].route
        assert route.read_mode == read_mode
        for i in (0, n - 1):
            assert peer.cmd("sha", offset=int(dst[i]) * page, length=page)["sha"] == sha(
                src[i * page : (i + 1) * page]
            )
        # READ them back, reversed, into the upper half of the buffer
        back = POOL // 2 + np.arange(n)[::-1] * page
        res = eng.transfer(Op.READ, local, back, seg, dst * page, page)
        assert res.transports == [TransportKind.NIXL]
        for i in range(n):
            off = int(back[i])
            assert sha(buf[off : off + page]) == sha(src[i * page : (i + 1) * page]), i
        # odd offsets and lengths go through as well
        eng.transfer(Op.READ, local, [3], seg, [int(dst[0]) * page + 5], [1001])
        assert sha(buf[3:1004]) == sha(src[5:1006])


def test_other_host_goes_to_tcp_without_rdma():
    """Host memory on another host: plain TCP unless RDMA is present (network=auto)."""
    with _peer("--host-id", "far-away-host") as peer, _engine() as eng:
        seg = eng.open_segment(peer.address, "pool")
        buf = np.zeros(POOL, np.uint8)
        local = eng.register(buf)
        res = eng.transfer(Op.READ, local, [0], seg, [0], [POOL])
        want = TransportKind.NIXL if na.has_rdma_devices() else TransportKind.TCP
        assert res.transports == [want]
        assert sha(buf) == sha(pattern(SEED, 0, POOL))


def test_other_host_reads_are_pushed():
    """A peer on "another host" with NIXL kept for the network: READs are owner pushes."""
    with _peer("--host-id", "far-away-host") as peer, _engine(network="nixl") as eng:
        assert eng.host_id != "far-away-host"
        seg = eng.open_segment(peer.address, "pool")
        buf = np.zeros(POOL, np.uint8)
        local = eng.register(buf)
        res = eng.transfer(Op.READ, local, [0], seg, [0], [POOL])
        assert res.transports == [TransportKind.NIXL]
        route = seg._routes[(MemoryKind.DRAM, -1)].route
        expected = "nixl" if na.has_rdma_devices() else "socket"
        assert route.read_mode == expected
        assert sha(buf) == sha(pattern(SEED, 0, POOL))
        buf[:4096] = 7
        eng.transfer(Op.WRITE, local, [0], seg, [POOL - 4096], [4096])
        assert peer.cmd("sha", offset=POOL - 4096, length=4096)["sha"] == sha(buf[:4096])


def test_peer_killed_mid_batch():
    size = 256 << 20
    with _peer(size=size) as peer, _engine() as eng:
        seg = eng.open_segment(peer.address, "pool")
        buf = np.ones(size, np.uint8)
        local = eng.register(buf)
        eng.transfer(Op.WRITE, local, [0], seg, [0], [4096])  # route + NIXL up
        outcome: list[BaseException | None] = []

        def writer() -> None:
            try:
                end = time.monotonic() + 60
                while time.monotonic() < end:
                    eng.transfer(
                        Op.WRITE,
                        local,
                        np.arange(16) * (16 << 20),
                        seg,
                        np.arange(16) * (16 << 20),
                        16 << 20,
                        timeout=30,
                    )
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        th = threading.Thread(target=writer)
        th.start()
        time.sleep(0.3)
        t_kill = time.monotonic()
        peer.kill()
        th.join(45)
        assert not th.is_alive(), "a batch hung after its peer died"
        assert outcome and isinstance(outcome[0], TransferError), outcome
        assert isinstance(outcome[0], PeerDeadError) or "dead" in str(outcome[0]).lower(), outcome
        assert time.monotonic() - t_kill < 25
        with pytest.raises(TransferError):
            eng.transfer(Op.WRITE, local, [0], seg, [0], [4096], timeout=10)


def test_unpublished_segment_is_refused(dram_peer):
    with _engine() as eng:
        seg = eng.open_segment(dram_peer.address, "pool")
        desc = seg.desc
        dram_peer.cmd("unpublish", name="pool")
        # Asking the owner for NIXL metadata of a segment it no longer publishes fails.
        tr = eng.transport(TransportKind.NIXL)
        with pytest.raises(SegmentNotFound):
            tr.open(desc)
        with pytest.raises(SegmentNotFound):
            eng.open_segment(dram_peer.address, "pool", refresh=True)


def test_lazy_agent_and_idle_cpu(dram_peer):
    """No NIXL agent until NIXL is used; an idle engine with one costs < 5 % of a core."""
    with _engine() as eng:
        tr = eng.transport(TransportKind.NIXL)
        assert tr is not None and not tr.started
        shm = eng.alloc_shared(1 << 20, name="mine")
        assert eng.segments()[0].nixl_agent == tr.agent_name
        assert not tr.started, "publishing a segment must not start NIXL"
        seg = eng.open_segment(dram_peer.address, "pool")
        eng.transfer(Op.READ, shm, [0], seg, [0], [1 << 20])
        assert tr.started
        assert sha(shm.array()[: 1 << 20]) == sha(pattern(SEED, 0, 1 << 20))
        time.sleep(0.2)
        pid = dram_peer.pid
        # The peer now runs a NIXL agent (it answered our metadata request) and idles.
        fracs = []
        for _ in range(2):
            c0, w0 = _cpu_seconds(pid), time.monotonic()
            time.sleep(1.5)
            fracs.append((_cpu_seconds(pid) - c0) / (time.monotonic() - w0))
        assert min(fracs) < 0.05, f"idle peer engine with NIXL used {min(fracs):.1%} of a core"


def test_vram_and_same_process_not_served():
    with _engine() as eng:
        tr = eng.transport(TransportKind.NIXL)
        buf = np.zeros(4096, np.uint8)
        local = eng.register(buf, name="self-seg")
        desc = eng.segments()[0]
        assert not tr.can_serve(local, desc), "same process is the local transport's job"
        other = type(desc)(
            **{
                f: getattr(desc, f)
                for f in desc.__struct_fields__
                if f not in ("pid", "kind", "device")
            },
            pid=desc.pid + 1,
            kind=MemoryKind.VRAM,
            device=0,
        )
        from kvmesh.transfer import cuda

        assert tr.can_serve(local, other) == cuda.available()
        host = type(desc)(
            **{f: getattr(desc, f) for f in desc.__struct_fields__ if f != "pid"}, pid=desc.pid + 1
        )
        assert tr.can_serve(local, host)
        no_nixl = type(desc)(
            **{
                f: getattr(desc, f)
                for f in desc.__struct_fields__
                if f not in ("pid", "nixl_agent")
            },
            pid=desc.pid + 1,
            nixl_agent=None,
        )
        assert not tr.can_serve(local, no_nixl)


def test_get_emulation_rules():
    assert nt.get_is_emulated("tcp", same_host=True, rdma=False)
    assert nt.get_is_emulated("tcp,self", same_host=True, rdma=True)
    assert not nt.get_is_emulated(None, same_host=True, rdma=False)
    assert not nt.get_is_emulated("cma,tcp", same_host=True, rdma=False)
    assert not nt.get_is_emulated("^ib", same_host=True, rdma=False)
    assert nt.get_is_emulated(None, same_host=False, rdma=False)
    assert not nt.get_is_emulated(None, same_host=False, rdma=True)
    with _engine(read_mode="sometimes") as eng:  # a bad option disables NIXL, loudly
        assert "read_mode" in eng.transport_status["nixl"]
        assert TransportKind.NIXL not in eng.transports


def test_without_nixl_falls_back_to_tcp():
    """With NIXL missing, the engine says why and DRAM segments move over plain TCP."""
    code = (
        "import os, numpy as np, sys, json\n"
        "from kvmesh.transfer import TransferEngine, Op, TransportKind\n"
        "eng = TransferEngine()\n"
        "status = eng.transport_status['nixl']\n"
        "seg = eng.open_segment(sys.argv[1], 'pool')\n"
        "buf = np.zeros(1 << 20, np.uint8); r = eng.register(buf)\n"
        "res = eng.transfer(Op.READ, r, [0], seg, [0], [1 << 20])\n"
        "print(json.dumps({'status': status, 'transports': [k.value for k in res.transports],"
        " 'head': buf[:16].tolist()}))\n"
        "eng.close()\n"
    )
    with _peer() as peer:
        env = dict(os.environ, KVMESH_NIXL_MODULE="no_such_nixl_module")
        out = subprocess.run(
            [sys.executable, "-c", code, peer.address],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        import json

        info = json.loads(out.stdout.strip().splitlines()[-1])
        assert "no_such_nixl_module" in info["status"]
        assert info["transports"] == ["tcp"]
        assert info["head"] == pattern(SEED, 0, 16).tolist()
