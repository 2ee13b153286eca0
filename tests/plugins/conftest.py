"""SGLang plugin tests: the torchvision stub goes in before anything imports sglang."""

from __future__ import annotations

import atexit
import os
import sys

from .sglang_env import add_plugins_path, install_torchvision_stub

install_torchvision_stub()
add_plugins_path()


def _silence_stderr() -> None:
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def pytest_report_header(config) -> str | None:
    """With ``KVMESH_EXPECT_SGLANG`` set (tests/plugins/test_sglang_0514.py runs these tests
    on another SGLang that way): the SGLang version imported and where from, and a usage
    error when it is not the expected one."""
    want = os.environ.get("KVMESH_EXPECT_SGLANG")
    if not want:
        return None
    import pytest
    import sglang

    got = getattr(sglang, "__version__", "?")
    if got != want:
        raise pytest.UsageError(f"expected SGLang {want}, imported {got} from {sglang.__file__}")
    return f"sglang {got} from {os.path.dirname(sglang.__file__)}"


def pytest_unconfigure(config) -> None:
    # SGLang imports triton, whose nanobind module lists "leaked" objects on stderr when the
    # interpreter shuts down, after pytest's summary (the last lines CI reads). atexit runs
    # after pytest restored its captured stderr and before that listing; the exit status is
    # unaffected.
    if "triton" in sys.modules:
        atexit.register(_silence_stderr)
