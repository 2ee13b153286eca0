"""The replog benchmark's code paths, tiny: every case runs, verifies its reads, and the
JSON follows docs/bench-format.md."""

import json
import os
import subprocess
import sys

from tests.bench_format import RECORD_FIELDS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_smoke(tmp_path):
    out = tmp_path / "replog.json"
    p = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "replog.py"),
            "--smoke",
            "--json",
            str(out),
            "--dir",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "limits: memcpy" in p.stdout and "failover" in p.stdout
    data = json.loads(out.read_text())
    assert data["bench"] == "replog" and data["smoke"] is True
    assert data["limits"]["memcpy_gbps"] > 0 and data["limits"]["tcp_gbps"] > 0
    fields = set(RECORD_FIELDS)
    recs = data["records"]
    for r in recs:
        assert fields <= set(r), r
    by = {(r["case"], r.get("durability")) for r in recs}
    assert {
        ("commit", "disk"),
        ("commit", "memory"),
        ("latency", "disk"),
        ("latency", "memory"),
        ("failover", "disk"),
    } <= by
    for r in recs:
        if r["case"] == "commit":
            assert r["ops_per_s"] > 0 and r["verified_reads"] > 0 and r["ratio_memcpy"] > 0
        if r["case"] == "latency":
            assert 0 < r["p50_us"] <= r["p99_us"]
    (fo,) = [r for r in recs if r["case"] == "failover"]
    assert fo["kills"] == 2 and fo["lost_writes"] == 0 and fo["linearizable"] == "ok"
    assert 0 < fo["p50_us"] <= fo["p99_us"]
    (rs,) = [r for r in recs if r["case"] == "restart"]
    assert rs["objects"] == 20_000 and rs["restart_s"] > 0 and rs["cluster_commit_s"] > 0
