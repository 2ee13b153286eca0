"""Leader finding, redirects and backoff for clients of a replicated group; no I/O.

The store's :class:`~kvmesh.store.rpc.MasterClient` (blocking sockets) and the replicated
log's :class:`~kvmesh.replog.net.client.ReplogClient` (asyncio) both send one request until some
replica answers it definitely. This module is that walk, once; the clients only do the I/O and
say what each answer was:

* try the known leader first, then the other replicas in random order (spreads load when no
  leader is known);
* a replica that fails (connection error, timeout) is forgotten as leader;
* a redirect to another address goes there at once; otherwise, after a round over every
  replica without an answer, pause (exponential backoff, capped) and start again;
* stop at the call's deadline; each attempt gets at most ``attempt_timeout`` of it.

Usage (blocking)::

    tries = finder.attempts(deadline, attempt_timeout)
    while (step := tries.next()) is not None:
        if step.addr is None:
            time.sleep(step.wait)
            continue
        ... send to step.addr before step.deadline, then call exactly one of
        tries.failed / tries.redirected / tries.retry / tries.succeeded (then return)
    raise Unavailable(tries.last)
"""

from __future__ import annotations

import random
import time
from typing import NamedTuple

__all__ = ["Attempts", "LeaderFinder", "LeaderFinderViews", "Step"]


class Step(NamedTuple):
    """Send to ``addr`` before ``deadline`` (monotonic); or, when ``addr`` is None, pause
    ``wait`` seconds first."""

    addr: str | None
    deadline: float
    wait: float = 0.0


class LeaderFinder:
    """The replicas of one group and what a client learned about them (shared by its calls).

    ``learn_redirects``: add a redirect's target to :attr:`addrs` when it is not there (the
    store's masters may be named by a subset of their addresses).
    """

    def __init__(
        self,
        addrs: list[str],
        *,
        rng: random.Random | None = None,
        first_backoff: float = 0.02,
        max_backoff: float = 0.5,
        learn_redirects: bool = False,
    ) -> None:
        self.addrs = list(addrs)
        self.leader: str | None = None
        self.redirects = 0
        self.retries = 0
        self.first_backoff = first_backoff
        self.max_backoff = max_backoff
        self.learn_redirects = learn_redirects
        self._rng = rng if rng is not None else random.Random()

    def candidates(self) -> list[str]:
        """One round's order: the leader (if known) first, the others shuffled."""
        order = list(self.addrs)
        if len(order) > 1:
            self._rng.shuffle(order)
        lead = self.leader
        if lead is not None:
            # Also a leader outside ``addrs``: a redirect names it and it authenticates anyway.
            if lead in order:
                order.remove(lead)
            order.insert(0, lead)
        return order

    def attempts(self, deadline: float, attempt_timeout: float) -> Attempts:
        return Attempts(self, deadline, attempt_timeout)


class Attempts:
    """The walk of one call; :attr:`last` describes the last failure (for the error)."""

    def __init__(self, finder: LeaderFinder, deadline: float, attempt_timeout: float) -> None:
        self.finder = finder
        self.deadline = deadline
        self.attempt_timeout = attempt_timeout
        self.last = "no attempt"
        self._queue: list[str] = []
        self._backoff = finder.first_backoff
        self._started = False
        self._redirected = False
        self._paused = False

    def next(self) -> Step | None:
        """The next thing to do, or None once the deadline has passed."""
        while True:
            now = time.monotonic()
            if self._queue:
                if now >= self.deadline:
                    return None
                addr = self._queue.pop(0)
                return Step(addr, min(self.deadline, now + self.attempt_timeout))
            if self._started and not self._redirected and not self._paused:
                if now >= self.deadline:
                    return None
                # A whole round without an answer: no leader right now (an election); wait.
                wait = min(self._backoff, self.finder.max_backoff, self.deadline - now)
                self._backoff = min(self._backoff * 2, self.finder.max_backoff)
                self._paused = True
                return Step(None, self.deadline, wait)
            self._started = True
            self._redirected = self._paused = False
            self._queue = self.finder.candidates()
            if not self._queue and now >= self.deadline:
                return None

    def _forget(self, addr: str) -> None:
        if self.finder.leader == addr:
            self.finder.leader = None

    def failed(self, addr: str, reason: str) -> None:
        """``addr`` did not answer (connection error, timeout, undecodable reply)."""
        self.last = f"{addr}: {reason}"
        self._forget(addr)
        self.finder.retries += 1

    def redirected(self, addr: str, leader_addr: str | None, reason: str) -> None:
        """``addr`` is not the leader; ``leader_addr`` is the one it names (or None)."""
        f = self.finder
        f.redirects += 1
        self.last = f"{addr}: {reason}"
        if leader_addr and leader_addr != addr:
            f.leader = leader_addr
            if f.learn_redirects and leader_addr not in f.addrs:
                f.addrs.append(leader_addr)
            self._queue = []  # go straight to the named leader, without a pause
            self._redirected = True
        else:
            self._forget(addr)

    def retry(self, addr: str, reason: str, *, forget_leader: bool = False) -> None:
        """``addr`` answered with an error after which another attempt is safe."""
        self.last = f"{addr}: {reason}"
        self.finder.retries += 1
        if forget_leader:
            self._forget(addr)

    def succeeded(self, addr: str) -> None:
        """``addr`` answered definitely: it is the leader from now on."""
        self.finder.leader = addr


class LeaderFinderViews:
    """Read-only views of a client's ``_finder`` (its replicas, counters), kept under the
    clients' historical attribute names."""

    _finder: LeaderFinder

    @property
    def addrs(self) -> list[str]:
        return self._finder.addrs

    @property
    def redirects(self) -> int:
        return self._finder.redirects

    @property
    def retries(self) -> int:
        return self._finder.retries
