"""The shared process launcher (kvmesh/launcher.py) on a tiny real child process."""

from __future__ import annotations

import signal
import socket
import sys

import pytest

from kvmesh.launcher import ProcessCluster, _ephemeral_range, free_ports

_CHILD = """
import signal, sys, time
mode = sys.argv[1]
if mode == "die":
    print("dying", file=sys.stderr, flush=True)
    sys.exit(4)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
print("READY", sys.argv[2], "0.25", flush=True)
while True:
    time.sleep(0.05)
"""


class _Tiny(ProcessCluster):
    role = "tiny"

    def __init__(self, base_dir: str, mode: str = "ok") -> None:
        super().__init__(base_dir, [1, 2])
        self.mode = mode

    def command(self, i: int) -> list[str]:
        return [sys.executable, "-c", _CHILD, self.mode, str(i)]

    def on_ready(self, i: int, line: str) -> float:
        return float(line.split()[2])


def test_lifecycle(tmp_path) -> None:
    with _Tiny(str(tmp_path)) as c:
        c.start_all(timeout=30)
        assert c.alive(1) and c.alive(2)
        with pytest.raises(RuntimeError, match="already running"):
            c.start(1)
        c.pause(2)
        assert c.stop(2, timeout=10) == 7  # SIGCONT first, so a paused child still exits
        c.kill(1)
        assert not c.alive(1) and c.procs[1].returncode == -signal.SIGKILL
        c.start(1, wait=False)
        assert c.wait_ready(1, timeout=30) == 0.25
    assert c.procs == {}


def test_exit_before_ready_reports_log(tmp_path) -> None:
    with _Tiny(str(tmp_path), mode="die") as c:
        c.start(1, wait=False)
        with pytest.raises(RuntimeError, match="tiny 1 exited with 4: dying"):
            c.wait_ready(1, timeout=30)
        assert (tmp_path / "tiny1.log").read_text() == "dying\n"


def test_free_ports_are_outside_the_ephemeral_range() -> None:
    """Ports handed to servers that bind them later come from below the kernel's ephemeral
    range: an unrelated connect() or bind(0) meanwhile never takes one (EADDRINUSE)."""
    lo, hi = _ephemeral_range()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(1024 <= p < lo or p > hi for p in ports), (ports, lo, hi)
    for p in ports:  # free right now
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
