"""bench/tier.py on a tiny file: the quick path keeps working and its JSON keeps the
bench-format.md shape (raw ceiling beside every kvmesh case, verified gets, ratios, targets)."""

from __future__ import annotations

import pytest

from tests.bench_format import run_bench


def test_tier_bench_quick_tiny(tmp_path):
    args = ["--quick", "--dir", str(tmp_path), "--file-mib", "8", "--batch-mib", "4"]
    args += ["--reps", "1", "--tcp-mib", "8", "--threads", "1"]
    proc, data = run_bench("tier", args, tmp_path, timeout=120)
    assert "targets:" in proc.stdout and "ratio disk" in proc.stdout
    limits = data["limits"]
    assert limits["disk_read_gbps"] > 0 and limits["disk_write_gbps"] > 0
    assert limits["tcp_gbps"] > 0
    recs = data["records"]
    # Without --buffered: O_DIRECT where the filesystem takes it, else both cache states.
    paths = ["direct"] if data["o_direct"] else ["cached", "cold-ish"]
    raw = {(r["path"], r["op"], r["pattern"], r["page_bytes"]) for r in recs if r["case"] == "raw"}
    for path in paths:
        ops = ("read",) if path == "cached" else ("read", "write")
        for op in ops:
            for pattern in ("seq", "rand4k"):
                for size in (256 << 10, 4 << 20):
                    assert (path, op, pattern, size) in raw
    kv = [r for r in recs if r["case"] in ("same-process", "through-owner")]
    want_local = {(p, op, s) for p in paths for op in ("put", "get") for s in (256 << 10, 4 << 20)}
    want_local -= {("cached", "put", s) for s in (256 << 10, 4 << 20)}
    got_local = {(r["path"], r["op"], r["page_bytes"]) for r in kv if r["case"] == "same-process"}
    assert got_local == want_local
    assert {r["transport"] for r in kv if r["case"] == "same-process"} == {"disk"}
    assert {r["transport"] for r in kv if r["case"] == "through-owner"} == {"tcp"}
    for r in kv:
        assert r["verified"] is True and r["gbps"] > 0
        assert r["ratio_disk"] is not None and r["ratio_disk"] > 0
        assert r["ratio_memcpy"] == pytest.approx(
            r["gbps"] / limits["memcpy_gbps"], rel=0.01, abs=1e-3
        )
    gets = [t for t in data["targets"] if "4 MiB" in t["target"]]
    assert gets and all("met" in t for t in gets)
