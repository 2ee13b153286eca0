"""bench/transfer.py on a tiny matrix: the quick path keeps working and its JSON keeps the
bench-format.md shape (every transport, verified transfers, ratios, latency, idle cost)."""

from __future__ import annotations

import os

import pytest

from kvmesh.transfer import fastcopy, nixl
from tests.bench_format import run_bench


def test_bench_quick_tiny(tmp_path):
    labels = ["local", "shm", "tcp"] + (["nixl", "nixl-tcp"] if nixl.available() else [])
    args = [
        "--quick",
        "--pages",
        "16384,65536",
        "--batches",
        "8",
        "--reps",
        "1",
        "--latency-samples",
        "20",
        "--pool-mib",
        "4",
        "--tcp-mib",
        "16",
        "--idle-seconds",
        "0.5",
        "--transports",
        ",".join(labels),
    ]
    proc, data = run_bench("transfer", args, tmp_path, timeout=120)
    assert "ratio memcpy" in proc.stdout and "targets:" in proc.stdout

    assert data["machine"]["cpus"] == os.cpu_count() and data["machine"]["python"]
    assert data["limits"]["memcpy_gbps"] > 0 and data["limits"]["tcp_gbps"] > 0
    samples = data["limit_samples"]
    assert len(samples["memcpy_gbps"]) == 1 + len(labels) and len(samples["tcp_gbps"]) == 2 + len(
        labels
    )
    assert data["limits"]["memcpy_gbps"] == pytest.approx(max(samples["memcpy_gbps"]), abs=1e-3)
    assert len(samples["copy_all_cores_gbps"]) == 2  # at the start and at the end
    assert data["limits"]["copy_all_cores_gbps"] == pytest.approx(
        max(samples["copy_all_cores_gbps"]), abs=1e-3
    )
    recs = data["records"]
    moves = [r for r in recs if r["case"] in ("same-process", "cross-process", "network")]
    # every transport, both directions, both page sizes, each verified
    assert {(r["path"], r["op"], r["page_bytes"]) for r in moves} == {
        (p, op, size) for p in labels for op in ("read", "write") for size in (16384, 65536)
    }
    expect_transport = {
        "local": "local",
        "shm": "shm",
        "tcp": "tcp",
        "nixl": "nixl",
        "nixl-tcp": "nixl",
    }
    for r in moves:
        assert r["verified"] is True and r["batch"] == 8
        assert r["transport"] == expect_transport[r["path"]], r
        assert r["gbps"] > 0 and r["ops_per_s"] > 0
        assert r["ratio_memcpy"] == pytest.approx(
            r["gbps"] / data["limits"]["memcpy_gbps"], rel=0.01, abs=1e-3
        )
        assert r["ratio_tcp"] == pytest.approx(
            r["gbps"] / data["limits"]["tcp_gbps"], rel=0.01, abs=1e-3
        )
        assert r["p50_us"] is None
    lat = [r for r in recs if r["case"] == "latency"]
    assert {(r["path"], r["op"]) for r in lat} == {
        (p, op) for p in labels for op in ("read", "write")
    }
    for r in lat:
        assert 0 < r["p50_us"] <= r["p99_us"] and r["page_bytes"] == 4096 and r["gbps"] is None
    # Idle engines block in the kernel: docs/transfer.md's target is < 5 % of a core per engine
    # (2-3 % with a NIXL agent polling at 1 ms). Both processes measured 2 % here (one 10 ms
    # tick in the 0.5 s window), also at load average 13 on 2 cores; 12 % leaves room for a
    # few ticks more, while busy-polling threads fail it even on that box (peer 13-17 %, this
    # process 51-99 % with the workers planted to spin on their queue).
    idle = {r["path"].split(" (")[0]: r["cpu_pct"] for r in recs if r["case"] == "idle"}
    assert set(idle) == {"peer engine", "this process"}, idle
    assert 0 <= idle["peer engine"] < 12 and 0 <= idle["this process"] < 12, idle
    assert data["targets"] and all("met" in t for t in data["targets"])


# The kernel is forced, so which rows are "selected" is known in advance and the test fails
# only when the bench marks the wrong kernel (it once matched a prefix of fastcopy's label,
# which never matched on a machine whose label starts "openblas dcopy"), never because this
# machine's probe would pick another kernel.
@pytest.mark.parametrize("kernel", fastcopy.KERNELS)
def test_copy_kernels_bench_quick_tiny(tmp_path, kernel):
    if kernel == "dcopy" and fastcopy.find_dcopy()[0] is None:
        pytest.skip("no bit-exact OpenBLAS dcopy here: only memmove can be selected")
    proc, data = run_bench(
        "copy_kernels", ["--quick", "--pool-mib", "8"], tmp_path, env={"KVMESH_COPY": kernel}
    )
    assert f"fastcopy selects: {kernel}" in proc.stdout
    assert data["kernel"] == kernel and "KVMESH_COPY" in data["backend"]
    kernels = {r["transport"] for r in data["records"]}
    assert "memmove" in kernels and ("dcopy" in kernels) is (fastcopy.find_dcopy()[0] is not None)
    cases = {(r["case"], r["page_bytes"]) for r in data["records"]}
    assert cases == {
        ("scattered pages", 128 << 10),
        ("scattered pages", 512 << 10),
        ("contiguous", 4 << 20),
    }
    assert all(r["gbps"] > 0 and r["ratio_memcpy"] > 0 for r in data["records"])
    for case in cases:  # exactly the forced kernel's row of every case
        rows = [r for r in data["records"] if (r["case"], r["page_bytes"]) == case]
        assert [r["transport"] for r in rows if r["selected"]] == [kernel], rows
