"""bench/store.py on a tiny matrix: every case still runs, reads are verified inside the
bench, and the JSON keeps the bench-format.md shape."""

from __future__ import annotations

from tests.bench_format import run_bench


def test_store_bench_tiny(tmp_path):
    args = [
        "--quick",
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
        "--failover-rounds",
        "2",
        "--put-stages",
        "3",
    ]
    _, data = run_bench("store", args, tmp_path)
    assert data["limits"]["memcpy_gbps"] > 0
    recs = data["records"]
    got = {(r["case"], r["op"]) for r in recs}
    assert {
        ("cross-process", "put"),
        ("cross-process", "get"),
        ("cross-process", "exists"),
        ("latency", "get"),
        ("network", "put"),
        ("network", "get"),
        ("metadata", "put"),
        ("failover", "put"),
    } <= got
    fo = [r for r in recs if r["case"] == "failover"]
    assert all(r["lost_keys"] == 0 and r["missed"] == 0 for r in fo), fo
    net = [r for r in recs if r["case"] == "network"]
    assert all(r["transport"] == "tcp" for r in net)  # the forced network path
    assert all(r["gbps"] > 0 for r in recs if r["gbps"] is not None)
    puts = [r for r in recs if r["op"] == "put" and r["case"] in ("cross-process", "network")]
    for r in puts:  # --put-stages: every stage timed, each within the whole put
        st = r["put_stages_us"]
        if "put_commit_round_trip" in st:  # one write, one PutCommit
            assert st["put_commit_round_trip"] > 0, st
        else:
            assert st["put_start_round_trip"] > 0 and st["put_end_round_trip"] > 0, st
        assert st["engine_write"] > 0 and st["master_cpu"] >= 0 and st["client_cpu"] > 0, st
        assert max(v for k, v in st.items() if k not in ("total", "master_cpu")) <= st["total"]
