"""Master replica processes on this host (tests, benchmarks, ``kvmesh up``).

``StoreCluster(base_dir, n=3)`` picks free ports for each replica's raft and store RPC
addresses and runs ``python -m kvmesh.store.service`` per replica with ``base_dir/N`` as its
data directory; it starts, kills (SIGKILL, like a crash), stops (SIGTERM) and restarts them.
Replica logs go to ``base_dir/masterN.log``. The token reaches the children through
``KVMESH_TOKEN`` in their environment (never on the command line).
"""

from __future__ import annotations

import os
import sys

from ..launcher import ProcessCluster, free_ports
from ..net.addr import join_host_port

__all__ = ["StoreCluster"]


class StoreCluster(ProcessCluster):
    """Start/stop/kill/pause: the shared :class:`kvmesh.launcher.ProcessCluster`."""

    role = "master"
    close_gracefully = True

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
        super().__init__(base_dir, list(range(1, n + 1)))
        ports = free_ports(2 * n, host)
        self.peers = {i: join_host_port(host, ports[i - 1]) for i in self.ids}
        self.addrs = {i: join_host_port(host, ports[n + i - 1]) for i in self.ids}
        self.token = token
        self.durability = durability
        self.tick_ms = tick_ms
        self.election_ticks = election_ticks
        self.extra_args = list(extra_args or [])

    @property
    def address(self) -> str:
        """All store RPC addresses, comma-separated (what ``StoreClient`` takes)."""
        return ",".join(self.addrs[i] for i in self.ids)

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
