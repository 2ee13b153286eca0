"""Helpers of the store end-to-end tests: master processes and client peer processes."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import Any

TOKEN = "e2e-store-token"


class Peer:
    """A ``tests.store.store_peer`` process (a StoreClient in another process)."""

    def __init__(
        self, master: str, segment: int, token: str = TOKEN, env: dict[str, str] | None = None
    ) -> None:
        e = dict(os.environ)
        e["E2E_STORE_TOKEN"] = token  # the master's token; the engines keep this process's
        e.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.store.store_peer", master, str(segment)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            env=e,
        )
        self.info = self._read(60)

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("store peer did not answer")
            r, _, _ = select.select([self.proc.stdout], [], [], left)
            if r:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"store peer exited with {self.proc.poll()}")
                return json.loads(line)

    def call(self, timeout: float = 60, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self._read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
