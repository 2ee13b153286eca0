"""Server processes on this host for tests, benchmarks and ``kvmesh up``: the one launcher.

:class:`ProcessCluster` starts numbered server processes (``python -m ...``), waits for the
``READY`` line each prints on stdout once it serves, and kills (SIGKILL, like a crash), stops
(SIGTERM, then SIGKILL), pauses and resumes them. stderr goes to ``base_dir/<role>N.log``. A
subclass says only how to run replica ``i`` (:meth:`~ProcessCluster.command`,
:meth:`~ProcessCluster.env`) and what its READY line carries
(:meth:`~ProcessCluster.on_ready`): :class:`kvmesh.replog.net.server.LocalCluster` and
:class:`kvmesh.store.cluster.StoreCluster`.
"""

from __future__ import annotations

import os
import random
import select
import signal
import socket
import subprocess
import time
from typing import Any, ClassVar, Self

from .net.addr import family_of

__all__ = ["ProcessCluster", "free_ports"]


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` right now (all bound at once, then released).

    They are taken below the kernel's ephemeral range when it leaves room: a port is chosen
    here and bound later by another process (and bound again when a killed replica restarts),
    and in between the kernel hands ephemeral ports to every ``connect()`` and ``bind(0)``
    on the host, so a port from that range can be taken by an unrelated client meanwhile
    (``EADDRINUSE`` at the server's start). Below the range only an explicit bind takes it.
    """
    host = host.strip("[]")
    family = family_of(host)
    lo, _ = _ephemeral_range()
    pool_lo = max(1024, lo - 16384)
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        if lo - pool_lo >= 4 * n:
            rng = random.Random()  # not the global one: tests seed it
            for _ in range(64 * n):
                if len(ports) == n:
                    break
                port = rng.randrange(pool_lo, lo)
                if port in ports:
                    continue
                s = socket.socket(family)
                try:
                    s.bind((host, port))
                except OSError:
                    s.close()
                    continue
                socks.append(s)
                ports.append(port)
        while len(ports) < n:  # no room below the range (or all tried were taken)
            s = socket.socket(family)
            socks.append(s)
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
        return ports
    finally:
        for s in socks:
            s.close()


class ProcessCluster:
    """Processes ``ids`` with data under ``base_dir``; see the module docstring."""

    #: Names the processes in log files and errors ("replica" -> ``replica2.log``).
    role: ClassVar[str] = "process"
    #: Whether :meth:`close` stops processes gracefully (SIGTERM) or kills them (SIGKILL).
    close_gracefully: ClassVar[bool] = False

    def __init__(self, base_dir: str, ids: list[int]) -> None:
        self.base_dir = base_dir
        os.makedirs(base_dir, exist_ok=True)
        self.ids = list(ids)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    # -- what a subclass says ---------------------------------------------------------------

    def command(self, i: int) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str] | None:
        """The child's environment (None: inherit ours)."""
        return None

    def on_ready(self, i: int, line: str) -> Any:
        """What :meth:`wait_ready` returns, from process ``i``'s READY line."""
        return None

    # -- the mechanism ----------------------------------------------------------------------

    @staticmethod
    def _spec(d: dict[int, str]) -> str:
        """``{1: "h:p", 2: ...}`` as the ``1=h:p,2=...`` a server's ``--peers`` takes."""
        return ",".join(f"{i}={a}" for i, a in sorted(d.items()))

    def log_path(self, i: int) -> str:
        return os.path.join(self.base_dir, f"{self.role}{i}.log")

    def start(self, i: int, wait: bool = True, timeout: float = 60.0) -> None:
        if self.alive(i):
            raise RuntimeError(f"{self.role} {i} is already running")
        with open(self.log_path(i), "ab") as logf:
            self.procs[i] = subprocess.Popen(
                self.command(i),
                stdout=subprocess.PIPE,
                stderr=logf,
                stdin=subprocess.DEVNULL,
                env=self.env(),
            )
        if wait:
            self.wait_ready(i, timeout)

    def wait_ready(self, i: int, timeout: float = 60.0) -> Any:
        """Wait for process ``i``'s READY line; returns :meth:`on_ready` of it."""
        p = self.procs[i]
        assert p.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{self.role} {i} not ready within {timeout}s (log: {self.log_tail(i)})"
                )
            r, _, _ = select.select([p.stdout], [], [], min(left, 0.5))
            if r:
                line = p.stdout.readline().decode()
                if line.startswith("READY"):
                    return self.on_ready(i, line)
                if not line and p.poll() is not None:
                    raise RuntimeError(
                        f"{self.role} {i} exited with {p.returncode}: {self.log_tail(i)}"
                    )

    def start_all(self, timeout: float = 60.0) -> None:
        for i in self.ids:
            self.start(i, wait=False)
        for i in self.ids:
            self.wait_ready(i, timeout)

    def alive(self, i: int) -> bool:
        p = self.procs.get(i)
        return p is not None and p.poll() is None

    def signal(self, i: int, sig: int) -> None:
        p = self.procs[i]
        if p.poll() is None:
            p.send_signal(sig)

    def kill(self, i: int) -> None:
        """SIGKILL (no cleanup, like a crash) and reap."""
        p = self.procs.get(i)
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()

    def stop(self, i: int, timeout: float = 10.0) -> int | None:
        """SIGTERM and wait (SIGKILL after ``timeout``); returns the exit code."""
        p = self.procs.get(i)
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
            p.terminate()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return p.returncode

    def pause(self, i: int) -> None:
        self.signal(i, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        self.signal(i, signal.SIGCONT)

    def log_tail(self, i: int, n: int = 2000) -> str:
        try:
            with open(self.log_path(i), "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        for i in list(self.procs):
            if self.close_gracefully:
                self.stop(i, timeout=5)
            else:
                self.kill(i)
            p = self.procs[i]
            if p.stdout is not None:
                p.stdout.close()
        self.procs.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
