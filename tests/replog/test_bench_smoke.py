"""The replog benchmark's code paths, tiny: every case runs, verifies its reads, and the
JSON follows docs/bench-format.md."""

from tests.bench_format import run_bench


def test_bench_smoke(tmp_path):
    args = ["--smoke", "--dir", str(tmp_path / "work")]
    p, data = run_bench("replog", args, tmp_path, timeout=240)
    assert "limits: memcpy" in p.stdout and "failover" in p.stdout
    assert data["smoke"] is True
    assert data["limits"]["memcpy_gbps"] > 0 and data["limits"]["tcp_gbps"] > 0
    recs = data["records"]
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
