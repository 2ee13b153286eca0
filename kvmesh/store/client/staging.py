"""Registered scratch buffers for the copying forms of the client (put of bytes, get
returning bytes)."""

from __future__ import annotations

import threading

import numpy as np

from ...transfer import MemoryRegion, TransferEngine

__all__ = ["Staging"]


_STAGING_MIN = 1 << 20


_STAGING_KEEP = 64 << 20


class Staging:
    """Registered scratch buffers for the copying forms (put of bytes, get returning bytes)."""

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._free: list[tuple[MemoryRegion, np.ndarray]] = []
        self._all: list[MemoryRegion] = []

    def acquire(self, nbytes: int) -> tuple[MemoryRegion, np.ndarray]:
        with self._lock:
            best = None
            for i, (r, _arr) in enumerate(self._free):
                if r.size >= nbytes and (best is None or r.size < self._free[best][0].size):
                    best = i
            if best is not None:
                return self._free.pop(best)
        size = max(_STAGING_MIN, 1 << max(0, (nbytes - 1).bit_length()))
        arr = np.empty(size, np.uint8)
        region = self.engine.register(arr)
        with self._lock:
            self._all.append(region)
        return region, arr

    def release(self, item: tuple[MemoryRegion, np.ndarray]) -> None:
        with self._lock:
            # Keep a few for reuse (registration is expensive), but not huge ones.
            if len(self._free) < 4 and item[0].size <= _STAGING_KEEP:
                self._free.append(item)
                return
            self._all.remove(item[0])
        self.engine.unregister(item[0])

    def close(self) -> None:
        with self._lock:
            regions, self._all, self._free = self._all, [], []
        for r in regions:
            try:
                self.engine.unregister(r)
            except Exception:  # noqa: BLE001
                pass
