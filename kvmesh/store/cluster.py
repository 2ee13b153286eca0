"""Master replica processes on this host (tests, benchmarks, ``kvmesh up``).

``StoreCluster(base_dir, n=3)`` picks free ports for each replica's raft and store RPC
addresses and runs ``python -m kvmesh.store.service`` per replica with ``base_dir/N`` as its
data directory; it starts, kills (SIGKILL, like a crash), stops (SIGTERM) and restarts them.
Replica logs go to ``base_dir/masterN.log``. The token reaches the children through
``KVMESH_TOKEN`` in their environment (never on the command line).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from ..replog.server import free_ports

__all__ = ["StoreCluster"]


class StoreCluster:
    def __init__(
        self,
        base_dir: str,
        n: int = 3,
        *,
        token: str | None = None,
        durability: str = "disk",
        tick_ms: float = 50.0,
        election_ticks: int = 10,
        extra_args: list[str] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.base_dir = base_dir
        os.makedirs(base_dir, exist_ok=True)
        ports = free_ports(2 * n, host)
        self.ids = list(range(1, n + 1))
        self.peers = {i: f"{host}:{ports[i - 1]}" for i in self.ids}
        self.addrs = {i: f"{host}:{ports[n + i - 1]}" for i in self.ids}
        self.token = token
        self.durability = durability
        self.tick_ms = tick_ms
        self.election_ticks = election_ticks
        self.extra_args = list(extra_args or [])
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def address(self) -> str:
        """All store RPC addresses, comma-separated (what ``StoreClient`` takes)."""
        return ",".join(self.addrs[i] for i in self.ids)

    def _spec(self, d: dict[int, str]) -> str:
        return ",".join(f"{i}={a}" for i, a in sorted(d.items()))

    def command(self, i: int) -> list[str]:
        return [
            sys.executable, "-m", "kvmesh.store.service",
            "--id", str(i),
            "--peers", self._spec(self.peers),
            "--addrs", self._spec(self.addrs),
            "--dir", os.path.join(self.base_dir, str(i)),
            "--durability", self.durability,
            "--tick-ms", str(self.tick_ms),
            "--election-ticks", str(self.election_ticks),
            *self.extra_args,
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.token:
            env["KVMESH_TOKEN"] = self.token
        else:
            env.pop("KVMESH_TOKEN", None)
        return env

    def start(self, i: int, wait: bool = True, timeout: float = 60.0) -> None:
        if self.alive(i):
            raise RuntimeError(f"master {i} is already running")
        with open(os.path.join(self.base_dir, f"master{i}.log"), "ab") as logf:
            self.procs[i] = subprocess.Popen(
                self.command(i),
                stdout=subprocess.PIPE,
                stderr=logf,
                stdin=subprocess.DEVNULL,
                env=self.env(),
            )
        if wait:
            self.wait_ready(i, timeout)

    def wait_ready(self, i: int, timeout: float = 60.0) -> None:
        p = self.procs[i]
        assert p.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"master {i} not ready within {timeout}s: {self.log_tail(i)}")
            r, _, _ = select.select([p.stdout], [], [], min(left, 0.5))
            if r:
                line = p.stdout.readline().decode()
                if line.startswith("READY"):
                    return
                if not line and p.poll() is not None:
                    raise RuntimeError(f"master {i} exited with {p.returncode}: {self.log_tail(i)}")

    def start_all(self, timeout: float = 60.0) -> None:
        for i in self.ids:
            self.start(i, wait=False)
        for i in self.ids:
            self.wait_ready(i, timeout)

    def alive(self, i: int) -> bool:
        p = self.procs.get(i)
        return p is not None and p.poll() is None

    def kill(self, i: int) -> None:
        p = self.procs.get(i)
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()

    def stop(self, i: int, timeout: float = 10.0) -> int | None:
        p = self.procs.get(i)
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.terminate()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return p.returncode

    def log_tail(self, i: int, n: int = 2000) -> str:
        try:
            with open(os.path.join(self.base_dir, f"master{i}.log"), "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        for i in list(self.procs):
            self.stop(i, timeout=5)
            p = self.procs[i]
            if p.stdout is not None:
                p.stdout.close()
        self.procs.clear()

    def __enter__(self) -> StoreCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
