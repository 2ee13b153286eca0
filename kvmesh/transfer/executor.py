"""Worker threads that run transfer jobs, with work stealing by waiters.

A submitted job is a :class:`Task` in one queue. Idle workers block on the queue (no CPU when
idle). A thread that waits for its batch first *claims* that batch's tasks still in the queue
and runs them itself: a submit-then-wait caller never pays a thread hand-off, while a caller
that submits and goes on with other work still gets its jobs done in the background, and a
large batch split into parts is worked on by the waiter and the workers together.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from .fastcopy import bulk_slot

if TYPE_CHECKING:  # pragma: no cover
    from .transports.base import TransferJob, Transport

log = logging.getLogger("kvmesh.transfer")


class Task:
    """One job bound to its transport and completion callback; runs exactly once."""

    __slots__ = ("job", "transport", "index", "handle", "on_done", "_claim")

    def __init__(
        self,
        job: TransferJob,
        transport: Transport,
        index: object,
        handle: object,
        on_done: Callable[[Task, BaseException | None], None],
    ) -> None:
        self.job = job
        self.transport = transport
        self.index = index  # request indices of the batch this task covers (slice or array)
        self.handle = handle  # the route handle the job holds (released on completion)
        self.on_done = on_done
        self._claim = [True]

    def claim(self) -> bool:
        """Take the task; True for exactly one caller (list.pop is atomic)."""
        try:
            self._claim.pop()
            return True
        except IndexError:
            return False

    @property
    def claimed(self) -> bool:
        return not self._claim

    def run(self, gate: bool = True) -> None:
        """Execute the claimed task and report the outcome (never raises). A CPU copy runs
        under :func:`~kvmesh.transfer.fastcopy.bulk_slot` unless ``gate`` is False (the caller
        holds a slot for a whole set of tasks)."""
        try:
            self.job.check()
            if gate and self.transport.cpu_copy:
                with bulk_slot(self.job.nbytes):
                    self.transport.execute(self.job)
            else:
                self.transport.execute(self.job)
        except BaseException as exc:  # reported to the batch; the worker must survive
            self.on_done(self, exc)
        else:
            self.on_done(self, None)


class Executor:
    """A fixed pool of daemon worker threads fed by one queue."""

    def __init__(self, workers: int) -> None:
        self._queue: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"kvmesh-worker-{i}", daemon=True)
            for i in range(max(1, workers))
        ]
        for t in self._threads:
            t.start()

    def submit(self, task: Task) -> None:
        self._queue.put(task)

    def _work(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            if task.claim():
                task.run()

    def close(self, timeout: float = 5.0) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout)
