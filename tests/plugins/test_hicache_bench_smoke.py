"""bench/hicache.py on a tiny matrix: every case still runs on real SGLang host pools, every
read is verified inside the bench (page digests), and the JSON keeps the bench-format.md
shape."""

from __future__ import annotations

import pytest

from tests.bench_format import run_bench

from .sglang_env import sglang_missing

pytestmark = pytest.mark.skipif(sglang_missing() is not None, reason=str(sglang_missing()))


def test_hicache_bench_tiny(tmp_path):
    layers, mha, mla = 4, 4, 8
    args = [
        "--quick",
        "--layers",
        str(layers),
        "--batches",
        f"{mha},{mla}",
        "--reps",
        "1",
        "--ratio-reps",
        "3",
        "--exists-samples",
        "10",
        "--tcp-mib",
        "16",
    ]
    _, data = run_bench("hicache", args, tmp_path)
    assert data["limits"]["memcpy_gbps"] > 0
    recs = data["records"]
    ops = ("batch_set_v1", "set-existing", "batch_get_v1", "store-get")
    want = {
        ("same-host", kind, layout, op)
        for kind in ("mha", "mla")
        for layout in ("page_first", "layer_first")
        for op in ops
    } | {("network", kind, "page_first", op) for kind in ("mha", "mla") for op in ops}
    small_layouts = ("page_first", "page_first_direct", "layer_first")
    want |= {("same-host-4k", "mla", layout, op) for layout in small_layouts for op in ops}
    io = [r for r in recs if r["op"] != "batch_exists"]
    assert {(r["case"], r["kind"], r["layout"], r["op"]) for r in io} == want
    # The small-page case: 256 pages of 4 KiB, against the one-buffer form of the same get.
    small = [r for r in io if r["case"] == "same-host-4k"]
    assert all(r["page_bytes"] == 4096 and r["batch"] == 256 for r in small)
    gets = {r["layout"]: r for r in small if r["op"] == "batch_get_v1"}
    assert set(gets) == set(small_layouts)
    # One range per page: against one buffer too; layer_first (4 ranges a page): not.
    assert [gets[x].get("ratio_one_buffer", 0) > 0 for x in small_layouts] == [True, True, False]
    for r in gets.values():
        assert r["ratio_store"] > 0 and r["ratio_store_p10"] > 0 and r["ratio_rounds"] == 15
    io = [r for r in io if r["case"] != "same-host-4k"]
    # Page bytes of the model shape at --layers (bf16): MHA K+V, MLA one 576-wide vector.
    page = {"mha": layers * 64 * 2 * 8 * 128 * 2, "mla": layers * 64 * 576 * 2}
    for r in io:
        assert r["page_bytes"] == page[r["kind"]], r
        assert r["batch"] == (mha if r["kind"] == "mha" else mla), r
        assert r["ops_per_s"] > 0
        if r["op"] != "set-existing":
            assert r["gbps"] > 0 and r["ratio_memcpy"] > 0
        # The same-host helper is reached over shared memory, the "other host" over TCP.
        assert r["transport"] == ("shm" if r["case"] == "same-host" else "tcp"), r
    for r in io:
        if r["op"] == "batch_get_v1":
            assert r["ratio_store"] > 0
    ex = {r["kind"]: r for r in recs if r["op"] == "batch_exists"}
    assert set(ex) == {"mha", "mla"}
    assert ex["mha"]["objects"] == 512 and ex["mla"]["objects"] == 256
    for r in ex.values():
        assert r["batch"] == 256 and 0 < r["p50_us"] <= r["p99_us"]
