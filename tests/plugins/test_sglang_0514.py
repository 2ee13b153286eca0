"""The HiCache backend, SGLang's Mooncake backend on kvmesh, and the PD plugin loader tests,
run again on SGLang 0.5.14 (the older of the two versions in sglang-interfaces.md).

scripts/setup.sh installs 0.5.14 and the pins in which it differs (§6) with ``--no-deps`` into
``.venv/sglang-0.5.14``, an overlay over the 0.5.23 environment: with that directory first on
``PYTHONPATH``, ``import sglang`` is 0.5.14 and everything else is shared. The tests run in a
subprocess, whose pytest header says which SGLang it imported (``tests/plugins/conftest.py``).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from .sglang_env import sglang_missing

ROOT = pathlib.Path(__file__).resolve().parents[2]
OVERLAY = ROOT / ".venv" / "sglang-0.5.14"
VERSION = "0.5.14"
FILES = ("test_hicache_backend.py", "test_hicache_mooncake_shim.py", "test_pd_plugin.py")
# Version-independent and slow (a master killed and restarted, seconds of timeouts and back-off):
# the backend's store-down handling is kvmesh's client and the backend's own code; the SGLang
# calls it makes (batch_set_v1/batch_get_v1/batch_exists/exists/get_stats on a host pool) are
# all made on 0.5.14 by the round-trip tests, which stay, as does every other test in FILES.
DESELECT = ("test_hicache_backend.py::test_store_down_then_restarted",)


def _why_not() -> str | None:
    if os.environ.get("KVMESH_SKIP_SGLANG") == "1":
        return "KVMESH_SKIP_SGLANG=1"
    if sglang_missing() is not None:
        return sglang_missing()
    if not (OVERLAY / "sglang").is_dir() and os.environ.get("CI", "").lower() not in (
        "1",
        "true",
    ):
        return f"no SGLang {VERSION} overlay at {OVERLAY} (scripts/setup.sh installs it)"
    return None


@pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))
def test_plugin_tests_pass_on_sglang_0_5_14():
    assert (OVERLAY / "sglang").is_dir(), f"CI without the SGLang {VERSION} overlay {OVERLAY}"
    here = pathlib.Path(__file__).parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(OVERLAY), str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env["KVMESH_EXPECT_SGLANG"] = VERSION
    # No -q: the header carries the SGLang line.
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "ignore"]
    proc = subprocess.run(
        [
            *cmd,
            *(str(here / f) for f in FILES),
            *(f"--deselect={(here / d).relative_to(ROOT)}" for d in DESELECT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # The header line conftest.py writes: the version and where it was imported from.
    m = re.search(r"^sglang (\S+) from (\S+)$", out, re.M)
    assert m, out[-4000:]
    assert m.group(1) == VERSION and m.group(2).startswith(str(OVERLAY)), m.group(0)
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 20, out[-2000:]
    assert " failed" not in out and " error" not in out, out[-4000:]
    assert f"{len(DESELECT)} deselected" in out, out[-2000:]  # node ids that still match
