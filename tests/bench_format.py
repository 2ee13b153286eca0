"""The record fields every bench JSON must carry (the shared docs' bench-format.md).

Kept on the test side on purpose, apart from ``bench._common.FIELDS``: the smoke tests check
the benches against the format document, not against the constant the benches use.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]

RECORD_FIELDS = (
    "case",
    "transport",
    "op",
    "page_bytes",
    "batch",
    "gbps",
    "ops_per_s",
    "p50_us",
    "p99_us",
    "ratio_memcpy",
    "ratio_copy_limit",
    "ratio_tcp",
)

# Same-run reference limits every bench measures (bench-format.md), in GB/s.
COPY_LIMITS = ("memcpy_gbps", "copy_all_cores_gbps")


def run_bench(
    name: str,
    args: list[str],
    tmp_path: Any,
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> tuple[Any, dict]:
    """Run ``bench/<name>.py`` with ``args`` plus ``--json`` into ``tmp_path``, from the repo
    root with it on PYTHONPATH; assert it exited 0, named itself ``name``, measured both
    :data:`COPY_LIMITS`, and that every record carries :data:`RECORD_FIELDS` with its
    ``ratio_copy_limit`` computed against ``limits.copy_all_cores_gbps``. Returns the
    finished process and the JSON."""
    out = pathlib.Path(tmp_path) / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["bench"] == name
    limits = data["limits"]
    for key in COPY_LIMITS:
        assert isinstance(limits.get(key), (int, float)) and limits[key] > 0, limits
    assert "all cores" in proc.stdout, "the all-cores copy limit is not printed"
    allc = limits["copy_all_cores_gbps"]
    for r in data["records"]:
        assert all(f in r for f in RECORD_FIELDS), r
        if r["gbps"] is None:
            assert r["ratio_copy_limit"] is None, r
        else:
            want = r["gbps"] / allc
            assert abs(r["ratio_copy_limit"] - want) <= max(2e-3, 0.01 * want), (r, allc)
    return proc, data
