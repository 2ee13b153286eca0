"""Who stalls an event loop: an opt-in watchdog thread that names the code holding the loop.

The replicated log reports *how late* its ticks are (``loop_lag_max_s`` in ``kvmesh status``)
but not *why*. With ``KVMESH_STALL_TRACE_MS=N`` every server started through
:func:`kvmesh.net.eventloop.run` also runs a :class:`StallWatch`: the loop stamps a clock every
``N / 4`` ms; a daemon thread that finds the stamp older than ``N`` ms samples the loop
thread's Python stack (``sys._current_frames``) every few milliseconds until the loop is back,
then logs the stall's length and the stacks it saw most, innermost frames last. Off (the
default) it costs nothing; on, one thread that sleeps between checks and a callback per
``N / 4`` ms on the loop.

The samples are of the thread, not of the loop's clock: a stall in C code (a long
``msgpack`` encode, a blocking syscall, a full GC pass) shows the Python frame that called it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import os
import sys
import threading
import time
import traceback

__all__ = ["ENV", "StallReport", "StallWatch", "threshold_from_env"]

ENV = "KVMESH_STALL_TRACE_MS"
_SAMPLE_S = 0.002  # between two samples of a stalled thread
_FRAMES = 12  # innermost frames kept per sample
_KEEP = 64  # reports kept in memory (the newest)

log = logging.getLogger("kvmesh.stall")


class StallReport:
    """One stall: how long the loop was held and the stacks seen, most frequent first."""

    __slots__ = ("seconds", "samples", "stacks", "gc_s", "gc_passes", "others")

    def __init__(
        self,
        seconds: float,
        samples: int,
        stacks: list[tuple[str, int]],
        gc_s: float = 0.0,
        gc_passes: tuple[int, ...] = (),
        others: list[tuple[str, int]] | None = None,
    ) -> None:
        self.others = others or []  # the other threads' stacks, most seen first
        self.seconds = seconds
        self.samples = samples
        self.stacks = stacks  # (formatted stack, times seen), most seen first
        self.gc_s = gc_s  # of which the cyclic GC ran (passes that ended in the stall)
        self.gc_passes = gc_passes  # their generations

    def format(self) -> str:
        gc_note = ""
        if self.gc_passes:
            gens = ", ".join(str(g) for g in self.gc_passes)
            gc_note = f"; cyclic GC {self.gc_s * 1e3:.0f} ms of it (generations {gens})"
        lines = [
            f"event loop held for {self.seconds * 1e3:.0f} ms ({self.samples} samples{gc_note})"
        ]
        for stack, n in self.stacks[:3]:
            lines.append(f"-- seen in {n} of {self.samples} samples:\n{stack}")
        for stack, n in self.others[:6]:
            lines.append(f"-- another thread, in {n} samples: {stack}")
        return "\n".join(lines)


class StallWatch:
    """Watch ``loop`` (run by thread ``loop_thread``) for stalls longer than ``threshold_s``."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, loop_thread: int, threshold_s: float
    ) -> None:
        if not threshold_s > 0:
            raise ValueError(f"stall threshold must be > 0 s, got {threshold_s!r}")
        self.threshold_s = threshold_s
        self.reports: collections.deque[StallReport] = collections.deque(maxlen=_KEEP)
        self._loop = loop
        self._tid = loop_thread
        self._stamp = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvmesh-stallwatch", daemon=True)
        self._gc_start = 0.0
        self._gcs: collections.deque[tuple[float, float, int]] = collections.deque(maxlen=256)

    def start(self) -> StallWatch:
        gc.callbacks.append(self._on_gc)
        self._loop.call_soon_threadsafe(self._beat)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        if self._thread.is_alive():
            self._thread.join(5)

    def _beat(self) -> None:
        self._stamp = time.monotonic()
        if not self._stop.is_set():
            self._loop.call_later(self.threshold_s / 4, self._beat)

    def _on_gc(self, phase: str, info: dict) -> None:
        # A pass runs in whichever thread allocated: only the loop thread's hold the loop.
        if threading.get_ident() != self._tid:
            return
        if phase == "start":
            self._gc_start = time.monotonic()
        else:
            now = time.monotonic()
            self._gcs.append((now, now - self._gc_start, info.get("generation", -1)))

    def _gc_in(self, since: float) -> tuple[float, tuple[int, ...]]:
        passes = [(d, g) for end, d, g in list(self._gcs) if end >= since]
        return sum(d for d, _ in passes), tuple(g for _, g in passes)

    def _sample(self, others: collections.Counter[str]) -> str | None:
        """The loop thread's stack; the other threads' go into ``others``: the loop may be
        waiting for the GIL one of them holds (a long C call: the loop thread then shows
        no frame past the loop's own)."""
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        mine = None
        for tid, frame in sys._current_frames().items():
            if tid == me:
                continue
            stack = "".join(traceback.format_stack(frame)[-_FRAMES:])
            if tid == self._tid:
                mine = stack
            else:
                others[f"[thread {names.get(tid, tid)}]\n{stack}"] += 1
        return mine

    def _watch(self) -> None:
        period = self.threshold_s / 4
        while not self._stop.wait(period):
            stamp = self._stamp
            # the beat is due every period: held = how long past its due time it is
            if time.monotonic() - stamp - period < self.threshold_s:
                continue
            seen: collections.Counter[str] = collections.Counter()
            others: collections.Counter[str] = collections.Counter()
            while self._stamp == stamp and not self._stop.is_set():
                s = self._sample(others)
                if s is not None:
                    seen[s] += 1
                time.sleep(_SAMPLE_S)
            held = time.monotonic() - stamp - period
            gc_s, gens = self._gc_in(stamp)
            report = StallReport(
                held, sum(seen.values()), seen.most_common(), gc_s, gens, others.most_common()
            )
            self.reports.append(report)
            log.warning("%s", report.format())


def threshold_from_env() -> float | None:
    """``KVMESH_STALL_TRACE_MS`` in seconds, ``None`` when unset; a value that is not a
    positive number of milliseconds raises ``ValueError``."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: expected milliseconds") from None
    if not ms > 0:
        raise ValueError(f"{ENV}={raw!r}: the stall threshold must be > 0 ms")
    return ms / 1e3
