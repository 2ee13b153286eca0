"""bench/pd.py on its smallest settings: both paths, the concurrent case and the call overhead
still run (each case is verified inside the bench: SHA-256 of the pages on both sides), and
the JSON keeps the bench-format.md shape."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from tests.bench_format import RECORD_FIELDS

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_pd_bench_tiny(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "pd.py"),
        "--quick",
        "--json",
        str(out),
        "--reps",
        "1",
        "--concurrent-tokens",
        "64",
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["bench"] == "pd"
    assert data["limits"]["memcpy_gbps"] > 0 and data["limits"]["tcp_gbps"] > 0
    g = data["geometry"]
    recs = data["records"]
    for r in recs:
        assert all(f in r for f in RECORD_FIELDS), r
        assert "meets" in r and r["target"]
    moves = [r for r in recs if r["case"] in ("same-host", "network")]
    assert {(r["case"], r["requests"]) for r in moves} == {
        (c, n) for c in ("same-host", "network") for n in (1, 16)
    }
    page = g["page_size"] * g["kv_heads"] * g["head_dim"] * 2  # one layer's page, bf16
    for r in moves:
        assert r["op"] == "write" and r["page_bytes"] == page, r
        assert r["gbps"] > 0 and 0 < r["p50_us"] <= r["p99_us"], r
        assert r["ratio_memcpy"] > 0 and r["ratio_tcp"] > 0
    # The decode process under another host id is reached over the network path.
    assert all(r["transport"] == "tcp" for r in moves if r["case"] == "network")
    assert {r["tokens"] for r in moves if r["requests"] == 16} == {64}
    over = [r for r in recs if r["case"] == "overhead"]
    assert over and all(r["batch"] == 1024 and r["cpu_us"] > 0 for r in over)
