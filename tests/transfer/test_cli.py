"""The kvmesh command: info and the two-process demo."""

import json
import subprocess
import sys


def _run(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_info_reports_host_and_transports():
    out = _run("info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["host_id"] and info["copy"]
    assert info["transports"]["local"] == "enabled" and info["transports"]["shm"] == "enabled"
    assert set(info["transports"]) == {"local", "nvlink", "cuda_ipc", "shm", "nixl", "tcp"}
    text = _run("info")
    assert text.returncode == 0 and "host id" in text.stdout and "tcp" in text.stdout


def test_demo_moves_and_verifies_kv_pages():
    out = _run(
        "demo",
        "transfer",
        "--pages",
        "16",
        "--layers",
        "4",
        "--rounds",
        "1",
        "--transports",
        "shm,tcp",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    rows = [ln.split() for ln in lines if ln.startswith(("shm ", "tcp "))]
    assert {(r[0], r[1], r[4], r[5]) for r in rows} == {
        ("shm", "write", "shm", "verified"),
        ("shm", "read", "shm", "verified"),
        ("tcp", "write", "tcp", "verified"),
        ("tcp", "read", "tcp", "verified"),
    }
    assert "every page verified" in lines[-1]
