"""Helpers shared by the transfer tests and their peer processes."""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

import numpy as np

from bench._common import Child

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


class Peer(Child):
    """A peer engine in a child process (tests/transfer/peer.py), driven by JSON lines."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        prefix: tuple[str, ...] = (),
    ) -> None:
        super().__init__(
            [*prefix, sys.executable, "-m", "tests.transfer.peer", *args],
            env=env,
            timeout=timeout,
            cwd=_ROOT,
        )
        self.address: str = self.info["address"]

    def cmd(self, cmd: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        return self.call(cmd, timeout, **kw)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
