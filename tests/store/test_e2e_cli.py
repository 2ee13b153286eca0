"""The store CLI as a user runs it: ``kvmesh up`` (foreground cluster, Ctrl-C stops it),
``kvmesh status --json``, ``kvmesh master`` + ``kvmesh node`` + a client."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request

from kvmesh.replog.net.server import free_ports
from kvmesh.store import StoreClient


def _kvmesh(*args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("KVMESH_TOKEN", None)  # loopback: no token needed
    return subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        **kw,
    )


_buffers: dict[int, str] = {}


def _line(p: subprocess.Popen, prefix: str, timeout: float = 60) -> str:
    """The first output line starting with ``prefix`` (reads the pipe unbuffered)."""
    fd = p.stdout.fileno()
    deadline = time.monotonic() + timeout
    while True:
        buf = _buffers.get(fd, "")
        while "\n" in buf:
            line, buf = buf.split("\n", 1)
            _buffers[fd] = buf
            if line.startswith(prefix):
                return line
        if time.monotonic() > deadline:
            raise AssertionError(f"no {prefix!r} line in time")
        r, _, _ = select.select([fd], [], [], 0.5)
        if r:
            data = os.read(fd, 65536)
            if not data:
                raise AssertionError(f"no {prefix!r} line; the process exited with {p.wait()}")
            _buffers[fd] = buf + data.decode(errors="replace")


def test_up_status_and_ctrl_c(tmp_path):
    p = _kvmesh(
        "up",
        "--durability",
        "memory",
        "--segment",
        "32MiB",
        "--tick-ms",
        "50",
        "--dir",
        str(tmp_path),
    )
    try:
        masters = _line(p, "masters").split()[1]
        _line(p, "Ctrl-C")
        st = subprocess.run(
            [sys.executable, "-m", "kvmesh.cli", "status", "--master", masters, "--json"],
            capture_output=True,
            timeout=60,
        )
        assert st.returncode == 0, st.stderr
        out = json.loads(st.stdout)
        assert [m["role"] for m in out["members"]].count("LEADER") == 1
        assert len(out["members"]) == 3
        assert len(out["leader"]["segments"]) == 1
        c = StoreClient(masters, timeout=10)
        try:
            c.put("cli-a", b"via kvmesh up")
            assert c.get("cli-a") == b"via kvmesh up"
        finally:
            c.close()
        p.send_signal(signal.SIGINT)
        assert p.wait(20) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
    end = time.monotonic() + 15  # the master replicas stopped with it (a poll: they exit)
    while True:
        procs = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        if str(tmp_path) not in procs or time.monotonic() > end:
            break
        time.sleep(0.1)
    assert str(tmp_path) not in procs


def test_master_and_node_commands(tmp_path):
    port, mport = free_ports(2)
    addr = f"127.0.0.1:{port}"
    m = _kvmesh(
        "master", "--listen", addr, "--dir", str(tmp_path / "m"), "--metrics-port", str(mport)
    )
    n = None
    try:
        _line(m, "READY")
        n = _kvmesh("node", "--master", addr, "--size", "16MiB")
        _line(n, "READY node")
        c = StoreClient(addr, timeout=10)
        try:
            c.put(["n1", "n2"], [b"1" * 1000, b"2" * 2000])
            assert c.get(["n1", "n2"]) == [b"1" * 1000, b"2" * 2000]
            assert c.status()["segments"][0]["size"] == 16 << 20
        finally:
            c.close()
        want = [
            # the first put: one PutCommit that reserves, one that writes into the
            # reservation; close() gives the reservation back with a third
            'kvmesh_store_requests_total{outcome="ok",type="PutCommitReq"} 3.0',
            "kvmesh_store_objects 2.0",
            "kvmesh_store_is_leader 1.0",
            'kvmesh_store_capacity_bytes{medium="memory"} 1.6777216e+07',
            'kvmesh_store_capacity_bytes{medium="disk"} 0.0',
        ]
        # The metrics view refreshes on the master's ticker: poll until it shows the puts
        # (a fixed 0.6 s sleep can end before the next refresh on a loaded machine).
        end = time.monotonic() + 15
        while True:
            url = f"http://127.0.0.1:{mport}/metrics"
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            if all(w in text for w in want) or time.monotonic() > end:
                break
            time.sleep(0.1)
        for w in want:
            assert w in text, (w, text[-3000:])
        n.send_signal(signal.SIGTERM)
        assert n.wait(20) == 0
        m.send_signal(signal.SIGTERM)
        assert m.wait(20) == 0
    finally:
        for p in (m, n):
            if p is not None:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                p.stdout.close()


def test_store_demo_verifies_every_page():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "demo",
            "--pages",
            "32",
            "--rounds",
            "2",
            "--page-kib",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "every page verified" in out.stdout
    lines = out.stdout.splitlines()
    assert "warm-up: 32 pages written, read twice, verified" in lines
    assert "round 2/2: 32 pages written, read twice, verified" in lines
    rows = [ln.split() for ln in lines if ln.startswith(("prefill ", "decode "))]
    # Per worker: the warm-up round's row, then the steady state's (the median of 2 rounds).
    by_worker: dict[str, list[list[str]]] = {}
    for r in rows:
        who = " ".join(r[:3]) if r[0] == "decode" else r[0]
        by_worker.setdefault(who, []).append(r)
    assert set(by_worker) == {"prefill", "decode same host", "decode other host"}, rows
    for who, rs in by_worker.items():
        assert [r[r.index("write" if who == "prefill" else "read") + 1 :][:2] for r in rs] == [
            ["warm-up", "32"],
            ["steady", "x2"],
        ], rs
        assert all(r[-1] == "ok" for r in rs), rs  # bytes verified
        assert all(r[-2] == ("tcp" if who == "decode other host" else "shm") for r in rs), rs
        if who != "prefill":
            assert all("100%" in r for r in rs), rs  # hit rate


def test_store_demo_default_is_mib_pages_a_few_hundred_mb_a_round():
    from kvmesh.store import demo

    assert demo.PAGE_BYTES == 1 << 20  # one page_first page of Llama-3.2-1B (32 tokens)
    assert 128 << 20 <= demo.PAGES * demo.PAGE_BYTES <= 512 << 20
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "demo", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "store 256" in out.stdout
