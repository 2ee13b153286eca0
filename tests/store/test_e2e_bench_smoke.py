"""bench/store.py on a tiny matrix: every case still runs, reads are verified inside the
bench, and the JSON keeps the bench-format.md shape."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from tests.bench_format import RECORD_FIELDS

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIELDS = RECORD_FIELDS


def test_store_bench_tiny(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "store.py"),
        "--quick",
        "--json",
        str(out),
        "--shapes",
        "16384x8",
        "--reps",
        "1",
        "--latency-samples",
        "10",
        "--meta-seconds",
        "0.5",
        "--tcp-mib",
        "16",
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
    assert data["bench"] == "store" and data["limits"]["memcpy_gbps"] > 0
    recs = data["records"]
    for r in recs:
        assert all(f in r for f in FIELDS)
    got = {(r["case"], r["op"]) for r in recs}
    assert {
        ("cross-process", "put"),
        ("cross-process", "get"),
        ("cross-process", "exists"),
        ("latency", "get"),
        ("network", "put"),
        ("network", "get"),
        ("metadata", "put"),
    } <= got
    net = [r for r in recs if r["case"] == "network"]
    assert all(r["transport"] == "tcp" for r in net)  # the forced network path
    assert all(r["gbps"] > 0 for r in recs if r["gbps"] is not None)
