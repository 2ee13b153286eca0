"""Helpers shared by the transfer tests and their peer processes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

_BLOCK = 1 << 20
_SKEW = 4093  # prime: consecutive MiB blocks get different shifts of the random block


def pattern(seed: int, offset: int, length: int) -> np.ndarray:
    """Deterministic pseudo-random bytes for ``[offset, offset + length)`` of a pool.

    Cheap for large pools (one random MiB, shifted per MiB) yet different for every page,
    so a misplaced page or a wrong offset shows up in a byte comparison.
    """
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 256, _BLOCK + _SKEW * 2, dtype=np.uint8)
    out = np.empty(length, dtype=np.uint8)
    pos = 0
    while pos < length:
        abs_off = offset + pos
        blk, within = divmod(abs_off, _BLOCK)
        n = min(_BLOCK - within, length - pos)
        shift = (blk * 7919) % _SKEW
        out[pos : pos + n] = block[shift + within : shift + within + n]
        pos += n
    return out


def sha(data: Any) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(data)).cast("B")).hexdigest()


class Peer:
    """A peer engine in a child process (tests/transfer/peer.py), driven by JSON lines."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        prefix: tuple[str, ...] = (),
    ) -> None:
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tests.transfer.peer", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=full_env,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
        self.info = self._read(timeout)
        self.address: str = self.info["address"]
        self.pid: int = self.proc.pid

    def _read(self, timeout: float) -> dict[str, Any]:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
        end = time.monotonic() + timeout
        try:
            while True:
                left = end - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError("peer process did not answer in time")
                line = self.proc.stdout.readline()  # type: ignore[union-attr]
                if not line:
                    raise RuntimeError(f"peer process exited (rc={self.proc.poll()})")
                line = line.strip()
                if line.startswith("{"):
                    msg = json.loads(line)
                    if "error" in msg:
                        raise RuntimeError(f"peer error: {msg['error']}")
                    return msg
        finally:
            sel.close()

    def cmd(self, cmd: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._read(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.cmd("exit", timeout=10)
            except Exception:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f:
                f.close()

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
