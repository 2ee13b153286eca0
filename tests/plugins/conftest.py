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


def pytest_unconfigure(config) -> None:
    # SGLang imports triton, whose nanobind module lists "leaked" objects on stderr when the
    # interpreter shuts down, after pytest's summary (the last lines CI reads). atexit runs
    # after pytest restored its captured stderr and before that listing; the exit status is
    # unaffected.
    if "triton" in sys.modules:
        atexit.register(_silence_stderr)
