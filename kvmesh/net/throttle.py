"""One log line per kind of event per interval, with a count of what was held back.

A flood of bad connections must not become a flood of log lines: at thousands of refused
handshakes a second, a line each costs a server more CPU than the refusals themselves and
fills its disk.
"""

from __future__ import annotations

import logging
import threading
import time


class LogThrottle:
    """``log(level, kind, msg, *args)``: logs at most once per ``interval`` seconds per
    ``kind``; the next line that gets through says how many it held back. Thread-safe."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._logger = logger
        self._interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def log(self, level: int, kind: str, msg: str, *args: object, exc_info: bool = False) -> None:
        if not self._logger.isEnabledFor(level):
            return
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -1e9) < self._interval:
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        if held:
            msg += f" (and {held} more like it in the last {self._interval:g} s)"
        self._logger.log(level, msg, *args, exc_info=exc_info)
