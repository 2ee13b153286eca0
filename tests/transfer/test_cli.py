"""The kvmesh command: info and the two-process demo."""

import json
import os
import re
import subprocess
import sys

import pytest


def _run(*args, timeout=120, env=None):
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_info_reports_host_and_transports():
    out = _run("info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["host_id"] and info["copy"]
    ck = info["copy_kernel"]
    assert ck["kernel"] in ("memmove", "dcopy") and ck["reason"] in info["copy"]
    assert info["transports"]["local"] == "enabled" and info["transports"]["shm"] == "enabled"
    assert set(info["transports"]) == {"disk", "local", "nvlink", "cuda_ipc", "shm", "nixl", "tcp"}
    st = os.statvfs("/dev/shm")
    assert info["shm"]["dir"] == "/dev/shm"
    assert info["shm"]["size_bytes"] == st.f_blocks * st.f_frsize
    assert 0 <= info["shm"]["free_bytes"] <= info["shm"]["size_bytes"]
    text = _run("info")
    assert text.returncode == 0 and "host id" in text.stdout and "tcp" in text.stdout
    assert re.search(r"shared memory /dev/shm: [\d,]+ MiB free of [\d,]+ MiB", text.stdout)


def test_info_shows_the_measured_copy_kernel_and_its_figures():
    from kvmesh.transfer import fastcopy

    if fastcopy.find_dcopy()[0] is None:
        pytest.skip("no bit-exact OpenBLAS dcopy: nothing is measured")
    out = _run("info", env={"KVMESH_COPY": "auto"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    copy = next(ln for ln in lines if "copy routine" in ln)
    assert "measured: dcopy" in copy
    for label, _ in fastcopy.PROBE_SHAPES:  # one line of figures per probe shape
        row = next(ln for ln in lines if ln.strip().startswith(label))
        assert re.search(r"memmove \d+\.\d, dcopy \d+\.\d GB/s", row), row
    assert any("probe of" in ln and "ms" in ln for ln in lines)
    forced = json.loads(_run("info", "--json", env={"KVMESH_COPY": "memmove"}).stdout)
    assert forced["copy"] == "memmove (KVMESH_COPY)" and forced["copy_kernel"]["gbps"] == {}
    assert forced["copy_kernel"]["probe_ms"] is None


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
