"""bench/pd.py on its smallest settings: both paths, the concurrent case and the call overhead
still run (each case is verified inside the bench: SHA-256 of the pages on both sides), and
the JSON keeps the bench-format.md shape."""

from __future__ import annotations

from tests.bench_format import run_bench


def test_pd_bench_tiny(tmp_path):
    # Two layers (four K/V buffers) and 16 MiB TCP reference streams: the same cases and
    # checks as 32 layers, on an eighth of the pool bytes to fill, move and digest.
    args = ["--quick", "--reps", "1", "--concurrent-tokens", "64", "--layers", "2"]
    _, data = run_bench("pd", [*args, "--tcp-mib", "16"], tmp_path)
    assert data["limits"]["memcpy_gbps"] > 0 and data["limits"]["tcp_gbps"] > 0
    g = data["geometry"]
    assert g["layers"] == 2
    recs = data["records"]
    for r in recs:
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
