"""Batches: many READ/WRITE requests submitted, tracked and completed together.

Requests are grouped by (op, local region, remote segment); each group becomes one or more
:class:`~kvmesh.transfer.transports.base.TransferJob` (groups bigger than ``split_bytes`` are
cut at request boundaries so that workers and the waiting thread copy in parallel).
Before a single byte moves, ``submit`` checks every request of every group against both
regions and picks a transport for every group; any bad request refuses the whole batch.

Per-request overhead is kept to list appends (``add``) or nothing at all (``add_many`` takes
numpy arrays); status is one ``int8`` per request, updated per job with one slice assignment.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from .errors import (
    BatchStateError,
    Cancelled,
    InvalidArgument,
    NotRegistered,
    PeerDeadError,
    SegmentNotFound,
    TransferError,
    TransferTimeout,
)
from .executor import Task
from .fastcopy import bulk_busy, bulk_slot
from .memory import MemoryRegion
from .ranges import as_int64, as_op, as_requests, check_ranges
from .segment import RemoteSegment, RouteHandle
from .transports.base import TransferJob
from .types import BatchState, EngineConfig, Op, RequestStatus, TransportKind

_WAIT_GRACE = 5.0  # seconds past the batch deadline before wait() gives up on a stuck job
_SPLIT_MIN_PAGE = 64 << 10  # mean request size below which CPU-copy jobs are not split
# RequestStatus values as plain ints: enum attribute access costs microseconds on hot paths.
_DONE = int(RequestStatus.DONE)
_FAILED = int(RequestStatus.FAILED)
_CANCELLED = int(RequestStatus.CANCELLED)
_OP_NAMES = {op: op.value for op in Op}  # Op.value is a descriptor call: too slow per request


class BatchContext:
    """What a batch needs from the engine that made it, and nothing else.

    The engine builds one and hands it to every :class:`Batch` (and to
    :func:`validate_requests`), so batches never reach into the engine:

    * ``config``: the engine's configuration (deadlines, inline and split sizes);
    * ``check_open()``: raises ``EngineClosed`` once the engine is closed;
    * ``is_registered(region)``: whether a local region belongs to the engine;
    * ``route(local, remote)``: the opened transport route for a (local region, segment);
    * ``submit(task)``: queue a task for the worker threads;
    * ``note_batch()``: count one submitted batch (engine statistics).
    """

    __slots__ = ("config", "check_open", "is_registered", "route", "submit", "note_batch")

    def __init__(
        self,
        config: EngineConfig,
        *,
        check_open: Callable[[], None],
        is_registered: Callable[[MemoryRegion], bool],
        route: Callable[[MemoryRegion, RemoteSegment], RouteHandle],
        submit: Callable[[Task], None],
        note_batch: Callable[[], None],
    ) -> None:
        self.config = config
        self.check_open = check_open
        self.is_registered = is_registered
        self.route = route
        self.submit = submit
        self.note_batch = note_batch


class BatchResult(msgspec.Struct, frozen=True, kw_only=True):
    """Outcome of a finished (or abandoned) batch."""

    state: BatchState
    requests: int
    nbytes: int
    failed: int
    transports: list[TransportKind]  # transports that completed at least one job
    elapsed_s: float
    error: str | None = None


class _Group:
    __slots__ = ("op", "local", "remote", "lo", "ro", "ln", "idx", "arrays")

    def __init__(self, op: Op, local: MemoryRegion, remote: RemoteSegment) -> None:
        self.op = op
        self.local = local
        self.remote = remote
        self.lo: list[int] = []
        self.ro: list[int] = []
        self.ln: list[int] = []
        self.idx: list[int] = []
        self.arrays: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = []

    def build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """int64 arrays (local offsets, remote offsets, lengths, request indices)."""
        los, ros, lns, idxs = [], [], [], []
        if self.ln:
            los.append(as_int64("local offsets", self.lo, copy=False))
            ros.append(as_int64("remote offsets", self.ro, copy=False))
            lns.append(as_int64("lengths", self.ln, copy=False))
            idxs.append(np.array(self.idx, dtype=np.int64))
        for lo, ro, ln, start in self.arrays:
            los.append(lo)
            ros.append(ro)
            lns.append(ln)
            idxs.append(np.arange(start, start + len(ln), dtype=np.int64))
        if len(lns) == 1:
            return los[0], ros[0], lns[0], idxs[0]
        idx = np.concatenate(idxs)
        order = np.argsort(idx, kind="stable")  # keep request order (matters for coalescing)
        return (
            np.concatenate(los)[order],
            np.concatenate(ros)[order],
            np.concatenate(lns)[order],
            idx[order],
        )


def check_usable(ctx: BatchContext, local: MemoryRegion, remote: RemoteSegment) -> None:
    """Raise unless ``local`` is registered here and ``remote`` is current and its owner alive."""
    if local.closed or not ctx.is_registered(local):
        raise NotRegistered(f"{local!r} is not registered with this engine")
    reason = remote.peer.liveness.dead_reason
    if reason is not None:
        raise PeerDeadError(
            f"owner of segment {remote.name!r} ({remote.peer.address}) is dead: {reason}"
        )
    if remote.stale_reason is not None:
        raise SegmentNotFound(f"segment {remote.name!r} is gone: {remote.stale_reason}")


def validate_requests(
    ctx: BatchContext,
    op: Op,
    local: MemoryRegion,
    remote: RemoteSegment,
    lo: np.ndarray,
    ro: np.ndarray,
    ln: np.ndarray,
    *,
    ranges_checked: bool = False,
) -> int:
    """Check requests (int64 arrays) against both regions; return their total bytes.

    ``ranges_checked``: the caller resolved every request inside ``local`` and ``remote``
    already (``transfer_by_address``), so only registration and liveness are checked here.
    """
    check_usable(ctx, local, remote)
    if ranges_checked:
        return int(ln.sum())
    desc = remote.desc
    return check_ranges(
        _OP_NAMES[op],
        ln,
        (lo, local.size, ("local", local)),
        (ro, desc.size, ("remote segment", desc.name)),
    )


class Batch:
    """A group of READ/WRITE requests submitted and completed together. Thread-safe.

    Typical use::

        with engine.batch() as b:
            b.add_many(Op.WRITE, pool, local_offsets, seg, remote_offsets, page_bytes)
            b.submit()
            result = b.wait()          # raises the first error (TransferError subclass)
    """

    def __init__(self, ctx: BatchContext) -> None:
        self._ctx = ctx
        self._lock = threading.Lock()
        self._groups: dict[tuple[Op, int, int], _Group] = {}
        self._n = 0
        self._state = BatchState.OPEN
        self._status: np.ndarray | None = None
        self._tasks: list[Task] = []
        self._pending = 0
        self._done = False
        self._event: threading.Event | None = None  # created only if someone must block
        self._error: BaseException | None = None
        self._served: set[TransportKind] = set()
        self._nbytes = 0
        self._t0 = 0.0
        self._t1 = 0.0
        self._deadline = 0.0

    def __len__(self) -> int:
        return self._n

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    # --- building -------------------------------------------------------------------------
    def _group(self, op: Op, local: MemoryRegion, remote: RemoteSegment) -> _Group:
        if self._state is not BatchState.OPEN:
            raise BatchStateError(f"cannot add requests to a {self._state.value} batch")
        op = as_op(op)
        if not isinstance(local, MemoryRegion):
            raise NotRegistered(
                "local memory must be a MemoryRegion from engine.register(), got "
                f"{type(local).__name__}"
            )
        if not isinstance(remote, RemoteSegment):
            raise InvalidArgument(
                "remote must be a RemoteSegment from engine.open_segment(), got "
                f"{type(remote).__name__}"
            )
        key = (op, id(local), id(remote))
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = _Group(op, local, remote)
        return g

    def add(
        self,
        op: Op,
        local: MemoryRegion,
        local_offset: int,
        remote: RemoteSegment,
        remote_offset: int,
        length: int,
    ) -> int:
        """Add one request; returns its index. Checked at ``submit``."""
        with self._lock:
            g = self._group(op, local, remote)
            i = self._n
            g.lo.append(local_offset)
            g.ro.append(remote_offset)
            g.ln.append(length)
            g.idx.append(i)
            self._n = i + 1
            return i

    def add_many(
        self,
        op: Op,
        local: MemoryRegion,
        local_offsets: Any,
        remote: RemoteSegment,
        remote_offsets: Any,
        lengths: Any,
    ) -> range:
        """Add ``len(local_offsets)`` requests from arrays (``lengths`` may be one integer).

        Returns the range of their request indices. The arrays are copied (as int64), so the
        caller may reuse them right away.
        """
        lo, ro, ln = as_requests(local_offsets, remote_offsets, lengths)
        with self._lock:
            g = self._group(op, local, remote)
            start = self._n
            g.arrays.append((lo, ro, ln, start))
            self._n = start + len(ln)
            return range(start, self._n)

    # --- submission -----------------------------------------------------------------------
    def submit(
        self, timeout: float | None = None, *, _sync: bool = False, _ranges_checked: bool = False
    ) -> Batch:
        """Check every request, pick transports, start moving bytes; returns at once.

        ``timeout`` (default: the engine's ``transfer_timeout``) is the batch deadline: a job
        still running past it fails with ``TransferTimeout``. On a bad request this raises
        and nothing moves; the batch stays open (free it).
        """
        ctx = self._ctx
        with self._lock:
            if self._state is not BatchState.OPEN:
                raise BatchStateError(f"cannot submit a {self._state.value} batch")
            ctx.check_open()
            cfg = ctx.config
            now = time.monotonic()
            self._deadline = now + (cfg.transfer_timeout if timeout is None else timeout)
            plans = []
            for g in self._groups.values():
                lo, ro, ln, idx = g.build()
                nbytes = validate_requests(
                    ctx, g.op, g.local, g.remote, lo, ro, ln, ranges_checked=_ranges_checked
                )
                plans.append((g, nbytes, lo, ro, ln, idx))
            # Every request is valid: now pick (and open) a transport route per group.
            routes = [ctx.route(g.local, g.remote) for g, *_ in plans]
            tasks = self._make_tasks(plans, routes, cfg.split_bytes)
            self._status = np.zeros(self._n, dtype=np.int8)
            self._tasks = tasks
            self._pending = len(tasks)
            self._nbytes = sum(t.job.nbytes for t in tasks)
            self._t0 = now
            self._state = BatchState.SUBMITTED
            if not tasks:
                self._finish_locked()
                return self
        if _sync:
            # Many small groups (a PD request: one per layer buffer) would pay a thread
            # hand-off each; CPU-copy transports run them here. Big batches fan out only when
            # their jobs are big too: jobs of <= inline_bytes handed to the workers ran slower
            # than in the caller (contended fence lock and GIL, docs/sglang.md "Shared-memory
            # pools: measured"), and concurrent sync callers are parallel by themselves.
            inline = len(tasks) == 1 or (
                all(t.transport.inline_ok for t in tasks)
                and (
                    self._nbytes <= cfg.split_bytes
                    or all(t.job.nbytes <= cfg.inline_bytes for t in tasks)
                    # Other bulk copies already hold the CPUs: fanning out would only queue
                    # the jobs behind them and hand the slots over at every job.
                    or (all(t.transport.cpu_copy for t in tasks) and bulk_busy())
                )
            )
        else:
            limit = cfg.inline_bytes
            inline = True
            for t in tasks:
                if not (t.transport.inline_ok and t.job.nbytes <= limit):
                    inline = False
                    break
        if inline:
            # One copy slot for the whole set (a slot per small job would hand it over between
            # threads at every job: fastcopy.bulk_slot).
            cpu = all(t.transport.cpu_copy for t in tasks)
            with bulk_slot(self._nbytes if cpu else 0):
                for t in tasks:
                    if t.claim():
                        t.run(gate=not cpu)
        else:
            for t in tasks:
                ctx.submit(t)
        return self

    def _make_tasks(self, plans: list, routes: list[RouteHandle], split: int) -> list[Task]:
        tasks: list[Task] = []
        held: list[tuple[MemoryRegion, RouteHandle]] = []
        try:
            for (g, nbytes, lo, ro, ln, idx), handle in zip(plans, routes):
                if len(ln) == 0:
                    continue
                n = len(ln)
                # Parts only pay off when the copies release the GIL most of the time: CPU-copy
                # transports with small pages would just pass the GIL around between threads.
                small = handle.transport.inline_ok and nbytes < n * _SPLIT_MIN_PAGE
                if (
                    nbytes <= split or n == 1 or small or not handle.transport.split_ok
                ):  # the common case: one job, no slicing
                    if not handle.acquire():
                        raise g.remote.gone_error()
                    try:
                        g.local.acquire()
                    except BaseException:
                        handle.release()
                        raise
                    held.append((g.local, handle))
                    i0 = int(idx[0])
                    index: object = slice(i0, i0 + n) if int(idx[-1]) - i0 + 1 == n else idx
                    job = TransferJob(
                        g.op,
                        g.local,
                        g.remote.desc,
                        handle.route,
                        lo.view(np.uint64),
                        ro.view(np.uint64),
                        ln.view(np.uint64),
                        nbytes,
                        self._deadline,
                        g.remote.peer.liveness,
                    )
                    tasks.append(Task(job, handle.transport, index, handle, self._on_done))
                    continue
                parts = [(0, n)]
                if n > 1:
                    cut = (
                        np.searchsorted(np.cumsum(ln), np.arange(split, nbytes, split), side="left")
                        + 1
                    )
                    edges = [0] + sorted(set(int(c) for c in cut if 0 < c < len(ln))) + [len(ln)]
                    parts = list(zip(edges[:-1], edges[1:]))
                for a, b in parts:
                    if not handle.acquire():
                        raise g.remote.gone_error()
                    try:
                        g.local.acquire()
                    except BaseException:
                        handle.release()
                        raise
                    held.append((g.local, handle))
                    plo, pro, pln = (
                        lo[a:b].view(np.uint64),
                        ro[a:b].view(np.uint64),
                        ln[a:b].view(np.uint64),
                    )
                    pidx = idx[a:b]
                    if len(pidx) and int(pidx[-1]) - int(pidx[0]) + 1 == len(pidx):
                        index = slice(int(pidx[0]), int(pidx[-1]) + 1)
                    else:
                        index = pidx
                    job = TransferJob(
                        g.op,
                        g.local,
                        g.remote.desc,
                        handle.route,
                        plo,
                        pro,
                        pln,
                        nbytes if len(parts) == 1 else int(pln.sum()),
                        self._deadline,
                        g.remote.peer.liveness,
                    )
                    tasks.append(Task(job, handle.transport, index, handle, self._on_done))
        except BaseException:
            for region, handle in held:
                region.release()
                handle.release()
            raise
        self._ctx.note_batch()
        return tasks

    # --- completion -----------------------------------------------------------------------
    def _on_done(self, task: Task, exc: BaseException | None) -> None:
        job = task.job
        job.local.release()
        task.handle.release()  # type: ignore[attr-defined]
        if exc is not None and not isinstance(exc, TransferError):
            err = TransferError(
                f"{task.transport.kind.value} transport failed on segment "
                f"{job.remote.name!r}: {exc!r}"
            )
            err.__cause__ = exc
            exc = err
        with self._lock:
            status = self._status
            if status is None:  # freed meanwhile
                return
            if exc is None:
                status[task.index] = _DONE
                self._served.add(task.transport.kind)
            else:
                status[task.index] = _CANCELLED if isinstance(exc, Cancelled) else _FAILED
                if self._error is None or isinstance(self._error, Cancelled):
                    self._error = exc
            self._pending -= 1
            if self._pending == 0:
                self._finish_locked()

    def _finish_locked(self) -> None:
        if self._state is BatchState.FREED:
            return
        self._t1 = time.monotonic()
        self._state = BatchState.DONE if self._error is None else BatchState.FAILED
        self._done = True
        if self._event is not None:
            self._event.set()

    # --- observing ------------------------------------------------------------------------
    @property
    def state(self) -> BatchState:
        return self._state

    def poll(self) -> BatchState:
        """Current state, without blocking."""
        return self._state

    def status(self) -> np.ndarray:
        """Per-request :class:`RequestStatus` values (a copy, ``int8``, in request order)."""
        with self._lock:
            if self._status is None:
                return np.zeros(self._n, dtype=np.int8)
            return self._status.copy()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def result(self) -> BatchResult:
        with self._lock:
            status = self._status
            if status is None or self._state is BatchState.DONE:
                failed = 0
            else:
                failed = int(np.count_nonzero(status >= _FAILED))
            end = self._t1 if self._done else time.monotonic()
            return BatchResult(
                state=self._state,
                requests=self._n,
                nbytes=self._nbytes,
                failed=failed,
                transports=list(self._served)
                if len(self._served) < 2
                else sorted(self._served, key=lambda k: k.value),
                elapsed_s=max(0.0, end - self._t0) if self._t0 else 0.0,
                error=None
                if self._error is None
                else f"{type(self._error).__name__}: {self._error}",
            )

    @property
    def transports(self) -> list[TransportKind]:
        """Transports that served this batch (so far)."""
        return sorted(self._served, key=lambda k: k.value)

    def wait(self, timeout: float | None = None, *, raise_on_error: bool = True) -> BatchResult:
        """Block until every request finished; the waiting thread helps run queued jobs.

        Raises ``TransferTimeout`` if ``timeout`` seconds pass first (default: the batch
        deadline plus a grace period, so a wait never hangs), and with ``raise_on_error`` the
        batch's first error if any request failed.
        """
        if self._state is BatchState.OPEN:
            raise BatchStateError("wait() on a batch that was not submitted")
        if self._state is BatchState.FREED:
            raise BatchStateError("wait() on a freed batch")
        if not self._done:
            for t in self._tasks:  # steal our own queued jobs: no thread hand-off
                if t.claim():
                    t.run()
            limit = (
                timeout
                if timeout is not None
                else max(0.0, self._deadline - time.monotonic()) + _WAIT_GRACE
            )
            if not self._block(limit):
                if timeout is None:  # a transport ignored its deadline: give up on it
                    self.cancel()
                raise TransferTimeout(
                    f"batch of {self._n} requests not finished after {limit:.2f}s "
                    f"({self._pending} of {len(self._tasks)} jobs pending)"
                )
        if raise_on_error and self._error is not None:
            raise self._error
        return self.result()

    def _block(self, timeout: float) -> bool:
        with self._lock:
            if self._done:
                return True
            if self._event is None:
                self._event = threading.Event()
            ev = self._event
        return ev.wait(timeout)

    # --- ending ---------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the batch: queued jobs never run, running ones stop at their next check."""
        for t in self._tasks:
            t.job.cancelled = True
            if t.claim():
                t.on_done(t, Cancelled("the batch was cancelled before this request ran"))

    def free(self) -> None:
        """Release the batch. An unfinished batch is cancelled first (bounded wait)."""
        if self._state is BatchState.FREED:
            return
        if self._state is BatchState.SUBMITTED and not self._done:
            self.cancel()
            self._block(max(0.0, self._deadline - time.monotonic()) + _WAIT_GRACE)
        with self._lock:
            self._state = BatchState.FREED
            self._groups = {}
            self._tasks = []
