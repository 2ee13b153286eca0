"""The record fields every bench JSON must carry (the shared docs' bench-format.md).

Kept on the test side on purpose, apart from ``bench._common.FIELDS``: the smoke tests check
the benches against the format document, not against the constant the benches use.
"""

from __future__ import annotations

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
