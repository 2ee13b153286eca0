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
    "ratio_tcp",
)


def run_bench(name: str, args: list[str], tmp_path: Any, timeout: float = 180) -> tuple[Any, dict]:
    """Run ``bench/<name>.py`` with ``args`` plus ``--json`` into ``tmp_path``, from the repo
    root with it on PYTHONPATH; assert it exited 0, named itself ``name``, and that every
    record carries :data:`RECORD_FIELDS`. Returns the finished process and the JSON."""
    out = pathlib.Path(tmp_path) / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["bench"] == name
    for r in data["records"]:
        assert all(f in r for f in RECORD_FIELDS), r
    return proc, data
